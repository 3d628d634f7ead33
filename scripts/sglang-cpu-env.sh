#!/usr/bin/env bash
# Make a CPU-only virtual environment in which SGLang 0.5.23's HiCache storage and host pool
# modules import, so kvtier's SGLang backend is tested against the real package without a GPU.
# SGLang is installed without its dependencies (they pull CUDA builds: flashinfer, sgl-kernel,
# torch 2.14.1 ...); the light modules its import chain needs are listed below, found by
# importing these modules until nothing was missing, also without dependencies:
#   sglang.srt.mem_cache.hicache_storage          (HiCacheStorage, HiCacheStorageConfig ...)
#   sglang.srt.mem_cache.storage.backend_factory  (StorageBackendFactory, the dynamic backend)
#   sglang.srt.mem_cache.memory_pool_host, .pool_host.mha, .pool_host.mla  (the host pools)
# torch is the CPU build 2.13.0 (not SGLang's pin, 2.14.1, which is a CUDA build here).
#
# One workaround: PyPI's torchvision wheels link CUDA's libraries, so their C ops never load
# over a CPU torch, and `import torchvision` then stops at two unguarded fake-op registrations
# (torchvision::nms, ::qnms). SGLang's model configs import torchvision.transforms (multimodal
# preprocessing, never run here). A .pth hook defines those two op schemas just before
# torchvision is first imported, so its Python modules load; no torchvision op runs.
#
# usage: scripts/sglang-cpu-env.sh VENV_DIR [pip args...]   (e.g. -e '.[test]' for kvtier)
set -euo pipefail
V=${1:?usage: sglang-cpu-env.sh VENV_DIR [pip args...]}; shift
python3 -m venv "$V"
"$V/bin/pip" install -q torch==2.13.0
if [ "$#" -gt 0 ]; then "$V/bin/pip" install -q "$@"; fi
"$V/bin/pip" install -q --no-deps sglang==0.5.23
"$V/bin/pip" install -q --no-deps \
  packaging numpy pyyaml tqdm requests urllib3 idna certifi charset_normalizer filelock fsspec \
  typing_extensions orjson psutil pybase64 msgspec pyzmq dill loguru \
  starlette anyio sniffio pydantic pydantic_core typing_inspection annotated_types \
  aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist \
  ipython traitlets transformers==5.19.0 tokenizers==0.23.2 safetensors regex huggingface_hub \
  httpx2 httpcore2 truststore h11 sentencepiece compressed_tensors gguf apache-tvm-ffi==0.1.11 \
  pillow torchvision==0.28.0
SITE=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat > "$SITE/_sglang_cpu_torchvision.py" <<'PY'
"""Lets torchvision's Python modules import over a CPU-only torch (scripts/sglang-cpu-env.sh)."""

import sys


class _DefineTorchvisionOps:
    # Runs once, when torchvision is first imported: defines the two op schemas its
    # _meta_registrations registers fakes for unguarded (the real ones live in its C
    # extension, which links CUDA's libraries and does not load here).
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        for op in ("nms", "qnms"):
            try:
                torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:
                pass  # the extension did load and defined it
        return None


sys.meta_path.insert(0, _DefineTorchvisionOps())
PY
echo "import _sglang_cpu_torchvision" > "$SITE/_sglang_cpu_torchvision.pth"
if "$V/bin/pip" list 2>/dev/null | grep -qi '^nvidia-'; then
  echo "error: CUDA packages were installed into $V; this environment must stay CPU-only" >&2
  exit 1
fi
cd /tmp
for m in sglang.srt.mem_cache.hicache_storage sglang.srt.mem_cache.storage.backend_factory \
         sglang.srt.mem_cache.memory_pool_host sglang.srt.mem_cache.pool_host.mha \
         sglang.srt.mem_cache.pool_host.mla; do
  "$V/bin/python" -W ignore -c "import $m" 2>/dev/null && echo "ok   $m" || echo "FAIL $m"
done
