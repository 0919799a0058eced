"""What an uploaded image must be before anyone decodes it: checked on its header (PIL only, no torch), so the
ingress refuses a bad keyframe or reference with a 4xx before it reaches a replica."""

from __future__ import annotations

import io
import warnings

from PIL import Image

# Keyframes and image references are resized to a canvas of at most ~1M pixels; a larger upload is refused
# before it is decoded (a few KB of PNG can declare billions of pixels: a decompression bomb).
MAX_UPLOAD_PIXELS = 4096 * 4096


def image_problem(data: bytes, max_pixels: int = MAX_UPLOAD_PIXELS, verify: bool = True) -> str | None:
    """What makes an encoded image unacceptable, found without decoding its pixels, or None.

    The header gives the size (PIL reads it lazily), refused over ``max_pixels``. With ``verify``, what is cheap
    to check beyond it: a PNG's chunks are read up to IEND with their CRCs (``Image.verify``: a truncated or
    corrupted file fails, a valid file whose deflate stream is broken does not), a JPEG's entropy-coded data is
    decoded at 1/8 scale (libjpeg's DCT scaling: a truncated file fails). Other formats' pixels are read only where
    the image is decoded (``decode_image``, on the replica)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the bound below is the lower one
            with Image.open(io.BytesIO(data)) as image:  # reads the header only
                width, height = image.size
                if width * height > max_pixels:
                    return f"is {width}x{height} pixels; images may have at most {max_pixels} pixels"
                if verify and image.format == "JPEG":
                    image.draft("RGB", (max(1, width // 8), max(1, height // 8)))
                    image.load()
                elif verify:
                    image.verify()
    except Image.DecompressionBombError as e:  # PIL's own bound, met before ours when a header declares billions
        return f"is too large to decode: {e}; images may have at most {max_pixels} pixels"
    except Exception as e:  # any parser failure is the upload's fault (PIL raises OSError, SyntaxError, struct...)
        return f"is not a decodable image: {e}"
    return None
