#!/usr/bin/env bash
# The GPU machine's one command for each proof (as root, from the repository root):
#   bash tests/gpu/run.sh tests [pytest args]          # tests/gpu: real CUDA scenarios
#   bash tests/gpu/run.sh blocks [pytest args]         # tests/gpu/test_torch_blocks.py only
#   bash tests/gpu/run.sh bench [bench args]           # bench/gpu_overhead.py: overhead, side by side
#   bash tests/gpu/run.sh blocks-bench [bench args]    # bench/torch_blocks_overhead.py: block tracing's cost
#   bash tests/gpu/run.sh depth-bench [bench args]     # bench/depth_overhead.py: each depth's cost, one process
#   bash tests/gpu/run.sh block-probe-cost [args]      # bench/block_probe_cost.py: a block's hit, trap and program
#   bash tests/gpu/run.sh block-hook-cost [args]       # bench/block_hook_cost.py: a block through kvtrace's in-process hook
#   bash tests/gpu/run.sh flight [pytest args]         # tests/gpu/test_flight_recorder.py: a real OOM's dump
#   bash tests/gpu/run.sh cupti [pytest args]          # tests/gpu/test_cupti.py: kvtrace run (CUPTI) vs the uprobes
#   bash tests/gpu/run.sh cupti-bench [bench args]     # bench/cupti_overhead.py: CUPTI's cost, side by side
#   bash tests/gpu/run.sh throughput [bench args]      # bench/api_throughput.py: events/s to gRPC subscribers (gcc: stubs)
#   bash tests/gpu/run.sh idle [bench args]            # bench/agent_idle.py: the idle agent's CPU, with and without NVML
#   bash tests/gpu/run.sh vllm [pytest args]           # tests/gpu/test_vllm*.py, with the vLLM bundle
#   bash tests/gpu/run.sh vllm-bench [bench args]      # bench/vllm_overhead.py: tokens/s untraced, traced, plugin
#   bash tests/gpu/run.sh vllm-depth [pytest args]     # tests/gpu/test_vllm_depth.py: a leak planted in vLLM, found
#   bash tests/gpu/run.sh vllm-depth-bench [--graphs]  # bench/depth_overhead.py --workload vllm: each depth's cost
#     (upload .vllm+.vllm1, `bash .vllm/install.sh`; then .vllm+.vllm2 and again: it lands in /tmp/vsite)
# That machine has torch but no bcc and no package registry: bcc comes as the bundle that
# ../shared/tools/bcc-bundle makes (.bcc/bcc-bundle.tar.xz), missing pure-Python packages as
# wheels in .whl/ (pip download --no-deps -d .whl pyelftools grpcio-health-checking==1.76.0
# grpcio-reflection==1.76.0 perfetto==0.59.1; and for `kvtrace run`, the cupti-python line of the machine's
# CUDA: pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_17_x86_64
# -d .whl cupti-python==13.0.1). Both are used only when bcc or a package is not importable already.
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:?usage: run.sh tests|blocks|depth|flight|cupti|bench|blocks-bench|depth-bench|block-probe-cost|block-hook-cost|cupti-bench|throughput|idle|vllm|vllm-bench|vllm-depth|vllm-depth-bench [args]}; shift
python=${PYTHON:-python3}

if ! $python -c 'import bcc' 2>/dev/null; then
  [ -d /opt/bcc/usr ] || [ -f .bcc/bcc-bundle.tar.xz ] || { echo "no bcc here and no .bcc/bcc-bundle.tar.xz (run ../shared/tools/bcc-bundle .bcc)" >&2; exit 1; }
  if [ ! -d /opt/bcc/usr ]; then mkdir -p /opt/bcc && tar -C /opt/bcc -xJf .bcc/bcc-bundle.tar.xz; fi
  K=$(uname -r); mkdir -p "/lib/modules/$K"
  [ -e "/lib/modules/$K/build" ] || ln -sfn /opt/bcc/usr/src/linux-headers-*-amd64 "/lib/modules/$K/build"
  [ -e "/lib/modules/$K/source" ] || ln -sfn /opt/bcc/usr/src/linux-headers-*-common "/lib/modules/$K/source"
  export LD_LIBRARY_PATH=/opt/bcc/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONPATH=/opt/bcc/usr/lib/python3/dist-packages${PYTHONPATH:+:$PYTHONPATH}
fi
[ -e /sys/kernel/tracing/uprobe_events ] || mount -t tracefs nodev /sys/kernel/tracing
if ! $python -c 'import elftools, grpc_health, grpc_reflection, perfetto, cupti' 2>/dev/null; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "missing Python packages and no wheels in .whl/" >&2; exit 1; }
  $python -m pip install -q --no-index --no-deps --target /tmp/kvtrace-site .whl/*.whl
  export PYTHONPATH=/tmp/kvtrace-site:$PYTHONPATH
fi
export PYTHONPATH=$PWD/agent:${PYTHONPATH:-}

case $what in
  tests) exec $python -m pytest tests/gpu -s -q -p no:cacheprovider "$@" ;;
  blocks) exec $python -m pytest tests/gpu/test_torch_blocks.py -s -q -p no:cacheprovider "$@" ;;
  flight) exec $python -m pytest tests/gpu/test_flight_recorder.py -s -q -p no:cacheprovider "$@" ;;
  cupti) exec $python -m pytest tests/gpu/test_cupti.py -s -q -p no:cacheprovider "$@" ;;
  cupti-bench) exec $python bench/cupti_overhead.py "$@" ;;
  bench) exec $python bench/gpu_overhead.py "$@" ;;
  throughput) exec $python bench/api_throughput.py "$@" ;;
  idle) exec $python bench/agent_idle.py "$@" ;;
  blocks-bench) exec $python bench/torch_blocks_overhead.py "$@" ;;
  depth-bench) exec $python bench/depth_overhead.py "$@" ;;
  block-probe-cost) exec $python bench/block_probe_cost.py "$@" ;;
  block-hook-cost) exec $python bench/block_hook_cost.py "$@" ;;
  depth) exec $python -m pytest tests/gpu/test_depth.py -s -q -p no:cacheprovider "$@" ;;
  vllm|vllm-bench|vllm-depth|vllm-depth-bench)
    [ -f /tmp/vsite/.vllm_bundle_ok ] || { echo "vLLM is not installed in /tmp/vsite: bash .vllm/install.sh (twice)" >&2; exit 1; }
    export PYTHONPATH=$PYTHONPATH:/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0
    if [ "$what" = vllm ]; then
      exec $python -m pytest tests/gpu/test_vllm.py tests/gpu/test_vllm_placement.py -s -q -p no:cacheprovider "$@"
    fi
    if [ "$what" = vllm-depth ]; then
      exec $python -m pytest tests/gpu/test_vllm_depth.py -s -q -p no:cacheprovider "$@"
    fi
    if [ "$what" = vllm-depth-bench ]; then exec $python bench/depth_overhead.py --workload vllm "$@"; fi
    exec $python bench/vllm_overhead.py "$@" ;;
  *) echo "usage: run.sh tests|blocks|depth|flight|cupti|bench|blocks-bench|depth-bench|block-probe-cost|block-hook-cost|cupti-bench|throughput|idle|vllm|vllm-bench|vllm-depth|vllm-depth-bench [args]" >&2; exit 2 ;;
esac
