#!/usr/bin/env bash
# Make a CPU-only virtual environment in which vLLM 0.33.0's kv_offload modules and its
# offloading connector import, so kvtier's vLLM integration is tested against the real package
# without a GPU (scripts/test-vllm.sh builds one with it, and benchmarks/vllm_replay.py runs in
# one). vLLM is installed without its dependencies, which would pull CUDA builds (torch 2.14.0,
# flashinfer ...); the light modules its import chain needs are listed below, also without
# dependencies, over the CPU torch 2.13.0. Extra arguments are installed into the environment
# last (e.g. -e '.[test]' for kvtier and its test tools).
#
# usage: scripts/vllm-cpu-env.sh VENV_DIR [pip args...]
set -euo pipefail
V=${1:?usage: scripts/vllm-cpu-env.sh VENV_DIR [pip args...]}; shift
python3 -m venv "$V"
"$V/bin/pip" install -q torch==2.13.0
"$V/bin/pip" install -q --no-deps vllm==0.33.0
"$V/bin/pip" install -q --no-deps \
  packaging numpy msgspec psutil pyzmq urllib3 regex transformers huggingface_hub tqdm \
  httpx2 httpcore2 idna h11 truststore pyyaml safetensors tokenizers \
  pydantic pydantic_core typing_inspection annotated_types cbor2 \
  aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist \
  requests certifi openai_harmony openai sniffio anyio pillow pybase64 cachetools \
  cloudpickle uvloop py-cpuinfo prometheus_client xgrammar apache-tvm-ffi \
  fastapi starlette annotated_doc opentelemetry-api partial_json_parser llguidance
if [ "$#" -gt 0 ]; then "$V/bin/pip" install -q "$@"; fi
if "$V/bin/pip" list 2>/dev/null | grep -qi '^nvidia-'; then
  echo "error: CUDA packages were installed into $V; this environment must stay CPU-only" >&2
  exit 1
fi
cd /tmp
for m in vllm.v1.kv_offload.base vllm.v1.kv_offload.cpu.manager \
         vllm.v1.kv_offload.tiering.manager vllm.v1.kv_offload.tiering.spec \
         vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler; do
  "$V/bin/python" -c "import $m" 2>/dev/null && echo "ok   $m" || echo "FAIL $m"
done
