#!/usr/bin/env bash
# h3serve's first GPU measurement (issues 15, 53) as ONE command on one lent H200, planned at <= 6 minutes of the
# session's device time, with what that machine has: Python 3.12, torch 2.11 + CUDA 13 (Triton), transformers,
# tokenizers, safetensors, pillow, numpy, pyyaml; no diffusers, no pydantic, no Ray, no flash-attn, no network, and
# at most 64 MiB carried over with the code.
#
# The parts, in order, each under its own hard cap (CAPS, seconds; tests/test_benchmarks.py holds the sum <= 360):
#
#   0. env           15 s  nvidia-smi, versions, h3serve's probe of the platform                    -> env.txt
#   1. single+compile 170 s  the released 33.1B transformer built on the device (random bf16), one T2VA request
#                          1344x768x124 (37,966 rows): s/step, MFU, peak memory; then diffusers' regional compile
#                          of the repeated blocks and the same request compiled             -> gpu_pipeline.{log,json}
#   2. reserve+pack2+max_rows 105 s  a new process (eager): the reserve measured by torch.cuda.mem_get_info at each
#                          step (in use before the process, by nvidia-smi; the CUDA context before the model; a cuBLAS
#                          GEMM's workspace; an NCCL communicator of one rank with device_id, a first all-reduce and
#                          an all-to-all: ~5 s); one pack of two (124 + 141 frames, ~81k rows); then the warm-up at
#                          the row budget (engine.max_rows_per_step 80,000) with mem_get_info before and after (what
#                          the device holds outside torch's allocator, and the allocator's slack), against the memory
#                          plan and its 4 GiB reserve, PROJECTED until this runs       -> gpu_pack.{log,json}
#   3. decode        30 s  a new process (no transformer): the released video VAE (random bf16, diffusers'
#                          _keep_in_fp32_modules fp32, TF32) decodes one clip's latents [1, 24, 37, 48, 84]
#                          serially, then split by its 196 whole tiles (each timed, blended by diffusers' code, frames
#                          compared bit for bit): wall time, peak memory; the split over 2-8 decoders PROJECTED from
#                          the tiles; then the audio VAE beside it                          -> gpu_decode.{log,json}
#   4. smoke         40 s  the serving path on the device (generate on the tiny checkpoint, padded packs, a
#                          released-size pack built there)                                          -> gpu_smoke.log
#
# 15 + 170 + 105 + 30 + 40 = 360 s (docs/BENCHMARKS.md section 6: what each part is projected to need). The machine's
# start comes on top (the device tool's, not this plan's). Attention is torch_varlen (torch.nn.attention.varlen),
# the STAND-IN for flash-attn, which the lent machine lacks and which has no offline wheel small enough to carry;
# every log and JSON names the backend it measured. Flex attention (cold Triton compiles) is opt-in: --flex adds the
# kernels' GPU tests (40 s cap). What runs on CPU runs here, not there: the meta-device projection (h3serve plan
# h3serve/deploy/serve_config.gpu.yaml --end-to-end) and every dry run.
#
# Every part saves its result as it finishes (each JSON is rewritten after each sub-part, logs are unbuffered), so a
# part cut at its cap loses only the sub-part it was in, and the parts after it still run.
#
# Prepare once, here (needs the network; 8.8 MB of wheels for CPython 3.12 on manylinux x86_64, never torch):
#
#   bash benchmarks/gpu_session.sh --prepare          # downloads them into .gpu-deps/ (git-ignored via info/exclude)
#
# then on the device, in one call, with room under the session's device minutes for the machine's start and a rerun:
#
#   run(command="bash benchmarks/gpu_session.sh", carry=[".gpu-deps"], timeout_s=420)
#
# and copy files_at/<machine>-<date>/ to benchmarks/results/<machine>-<date>/. On any CUDA node with the project
# installed it runs as is (nothing to install there) and writes into benchmarks/results/<machine>-<date>/.
#
#   bash benchmarks/gpu_session.sh --dry-run          # on CPU: every part at the tiny dims, every check but the CUDA
#                                                     # calls; the plan's caps; the carried wheels, when present
set -uo pipefail
cd "$(dirname "$0")/.."

DRY="" FLEX="" PREPARE="" USED_BEFORE=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        --flex) FLEX=1 ;;
        --prepare) PREPARE=1 ;;
        *) echo "usage: bash benchmarks/gpu_session.sh [--dry-run] [--flex] | --prepare"; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
# each part's hard cap in seconds, in the order they run: the plan is their sum (<= 360)
CAPS=(15 170 105 30 40)
FLEX_CAP=40
CARRY_LIMIT=$((64 * 1024 * 1024))  # what the device tool carries with the code
WHEELS=("diffusers==0.42.1" "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0"
    "typing-inspection==0.4.5" "typing-extensions==4.16.0")

if [ -n "$PREPARE" ]; then
    grep -qx '/.gpu-deps/' .git/info/exclude 2>/dev/null || echo /.gpu-deps/ >> "$(git rev-parse --git-path info/exclude)"
    exec $PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu-deps "${WHEELS[@]}"
fi

fail() { echo "gpu_session: $*"; exit 2; }

# The carried wheels, when present: exactly the pins, within what the device tool carries.
if [ -d .gpu-deps ]; then
    for pin in "${WHEELS[@]}"; do
        name=${pin%%==*} version=${pin##*==}
        ls .gpu-deps/"${name//-/_}"-"$version"-*.whl >/dev/null 2>&1 || fail ".gpu-deps lacks $pin (run --prepare)"
    done
    size=$(du -sb .gpu-deps | cut -f1)
    [ "$size" -le "$CARRY_LIMIT" ] || fail ".gpu-deps is $size bytes, over the $CARRY_LIMIT the device tool carries"
fi

# What the benchmarks need beyond the machine's image: installed already (this machine, a CUDA node with the
# project), or from the carried wheels into a temporary site beside the image's. Neither: say how, do nothing.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c "import diffusers, pydantic" 2>/dev/null; then
    [ -d .gpu-deps ] || fail "diffusers and pydantic are missing and .gpu-deps is not here: run 'bash benchmarks/gpu_session.sh --prepare' where the network is, then carry .gpu-deps"
    SITE=$(mktemp -d)/site
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu-deps/*.whl \
        || fail "installing .gpu-deps failed"
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 H3SERVE_CACHE=${H3SERVE_CACHE:-/tmp/h3serve-cache}
$PY -c "import torch, diffusers, pydantic, benchmarks.gpu_pipeline, benchmarks.gpu_decode, benchmarks.gpu_smoke" \
    || fail "the benchmarks do not import here (see above); nothing measured"

if [ -n "$DRY" ]; then
    DEST="${OUT:-$(mktemp -d)}/dry-run"
    MODE=(--cpu-dry-run) BACKEND=auto MAX_ROWS=(--max-rows 2000) DEVICE=cpu
    # the caps are the device's plan; on a shared CPU the same parts at the tiny dims get 4x (a dry run checks the
    # steps, it does not time them), so a loaded CI machine never cuts one
    for i in "${!CAPS[@]}"; do CAPS[i]=$((CAPS[i] * 4)); done
else
    MACHINE=$($PY -c "import torch; print(torch.cuda.get_device_name(0).lower().removeprefix('nvidia ')
          .replace(' ', '-') if torch.cuda.is_available() else 'no-gpu')")
    [ "$MACHINE" != no-gpu ] || fail "no CUDA device here (--dry-run runs the parts on CPU)"
    DEST="${OUT:-benchmarks/results}/${MACHINE}-$(date -u +%Y-%m-%d)"
    MODE=() BACKEND=torch_varlen MAX_ROWS=() DEVICE=cuda
    # the device in use before part 2's process makes its context: what the reserve's measure starts from
    USED_BEFORE=(--used-before-mib "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)")
fi
mkdir -p "$DEST"
PLAN=0
for cap in "${CAPS[@]}"; do PLAN=$((PLAN + cap)); done
echo "gpu_session: writing to $DEST (caps: ${CAPS[*]} s = $PLAN s)"

# 0. the machine, the libraries, h3serve's view of the platform, and which attention kernel the numbers are of
export DRY DEVICE BACKEND PY
timeout "${CAPS[0]}" bash -c '
    [ -z "$DRY" ] && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -c "import sys, torch, diffusers, pydantic, transformers; print(\"python\", sys.version.split()[0],
        \"| torch\", torch.__version__, \"cuda\", torch.version.cuda, \"| diffusers\", diffusers.__version__,
        \"| transformers\", transformers.__version__, \"| pydantic\", pydantic.__version__)"
    $PY -c "from h3serve.attention import probe_platform; print(probe_platform(\"$DEVICE\").model_dump_json(indent=1))"
    [ "$BACKEND" = torch_varlen ] && echo "attention: torch_varlen, the STAND-IN for flash-attn (not on this machine)"
    true' 2>&1 | tee "$DEST/env.txt"

# 1. one released-size request, eager, then regionally compiled (single first: saved before compile starts)
timeout "${CAPS[1]}" $PY -m benchmarks.gpu_pipeline ${MODE[@]+"${MODE[@]}"} --backend "$BACKEND" \
    --parts single compile --max-seconds $((CAPS[1] - 20)) --json "$DEST/gpu_pipeline.json" \
    2>&1 | tee "$DEST/gpu_pipeline.log"

# 2. a new process (no compiled blocks): the reserve's parts, one pack of two, then the warm-up at the row budget
timeout "${CAPS[2]}" $PY -m benchmarks.gpu_pipeline ${MODE[@]+"${MODE[@]}"} --backend "$BACKEND" \
    --parts reserve pack2 max_rows ${MAX_ROWS[@]+"${MAX_ROWS[@]}"} ${USED_BEFORE[@]+"${USED_BEFORE[@]}"} \
    --max-seconds $((CAPS[2] - 20)) --json "$DEST/gpu_pack.json" 2>&1 | tee "$DEST/gpu_pack.log"

# 3. a new process (no transformer): one released clip's decode, serial then split by whole tiles, then its audio
timeout "${CAPS[3]}" $PY -m benchmarks.gpu_decode ${MODE[@]+"${MODE[@]}"} --max-seconds $((CAPS[3] - 8)) \
    --json "$DEST/gpu_decode.json" 2>&1 | tee "$DEST/gpu_decode.log"

# 4. the serving path on the device: a tensor made on the wrong device fails every step of a replica
timeout "${CAPS[4]}" $PY -m benchmarks.gpu_smoke ${MODE[@]+"${MODE[@]}"} 2>&1 | tee "$DEST/gpu_smoke.log"
SMOKE=${PIPESTATUS[0]}

# opt-in: flex attention's and the varlen kernels' GPU tests (cold Triton compiles)
if [ -n "$FLEX" ] && [ -z "$DRY" ]; then
    timeout "$FLEX_CAP" $PY -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_attention_gpu.py \
        tests/test_attention_flex.py 2>&1 | tee "$DEST/gpu_tests.log"
fi

ls -l "$DEST"
if [ "$SMOKE" -ne 0 ]; then
    echo "gpu_session: FAILED: the serving path does not run on $DEVICE (see $DEST/gpu_smoke.log)"
    exit 1
fi
