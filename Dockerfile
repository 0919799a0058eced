# syntax=docker/dockerfile:1
# h3serve on Ray's GPU image. This Ray version, rayVersion in k8s/rayservice.yaml and the
# ray[serve]==2.60.* pin in pyproject.toml must agree: tests/test_k8s.py checks all three.
#
#   docker build -t ghcr.io/your-org/h3serve:0.1.0 \
#     --build-arg FLASH_ATTN_WHEEL=<URL or path of a prebuilt flash-attn wheel> .
FROM rayproject/ray:2.60.0-py311-gpu

# torch and flash-attn go first, in their own layers: they are gigabytes and change far less often
# than h3serve. The torch build must match the flash-attn wheel (torch minor, CUDA major, C++11 ABI,
# Python 3.11); the defaults match h3serve/deploy/platforms/h100-flash-attn.json.
# torchvision comes with it: Qwen3-VL's video processor needs it for video references.
ARG TORCH_SPEC="torch==2.9.1 torchvision==0.24.1"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" ${TORCH_SPEC}

# flash-attn has no generic wheel on PyPI. Installing it from source compiles CUDA kernels: that needs
# nvcc (the full CUDA toolkit, not only the runtime) and takes a long time, unless its setup.py finds a
# matching prebuilt wheel on the flash-attention GitHub releases at build time. For reproducible builds
# pin that prebuilt wheel (or a copy in your own mirror) with FLASH_ATTN_WHEEL.
ARG FLASH_ATTN_WHEEL=""
RUN if [ -n "${FLASH_ATTN_WHEEL}" ]; then \
        pip install --no-cache-dir "${FLASH_ATTN_WHEEL}"; \
    else \
        pip install --no-cache-dir packaging ninja psutil einops \
        && pip install --no-cache-dir --no-build-isolation "flash-attn>=2.6"; \
    fi

# h3serve itself, with the cuda extra (flash-attn is already satisfied above) and the model libraries
# (diffusers, transformers, accelerate). Installed as a regular package so Serve imports
# h3serve.deploy.driver.app:build_app from site-packages; the source copy is removed. The checkpoint is not in the
# image: it is mounted (k8s/weights-pvc.yaml). HF_HUB_OFFLINE keeps every load local.
COPY --chown=ray:users . /tmp/h3serve-src
RUN cd /tmp/h3serve-src \
    && pip install --no-cache-dir ".[cuda]" \
    && cd / && rm -rf /tmp/h3serve-src \
    && python -c "import h3serve.deploy.driver.app, h3serve.attention, h3serve.pipelines.h3, h3serve.replicas" \
    && h3serve --help > /dev/null

# The base image's non-root user (uid 1000, gid 100); the k8s pods run as that uid too.
ENV HF_HUB_OFFLINE=1
USER ray
WORKDIR /home/ray
