# Which package index pip takes torch from. Sourced by scripts/setup.sh;
# tests/test_setup_scripts.py runs torch_index_args on every case.
#
# torch's builds on PyPI for Linux are the CUDA ones (several GB with their
# nvidia-* wheels); PyTorch's CPU wheels (about 200 MB) live on their own
# index. So where no NVIDIA GPU is seen, pip also looks there. The index is
# passed with --extra-index-url, never --index-url: pip picks the highest
# version among all the indexes it knows, and 2.13.0+cpu sorts above 2.13.0,
# so the CPU wheel wins where that index answers; where it does not (a
# machine that reaches only a PyPI mirror, with a CPU wheel of its own), pip
# warns, retries for about 10 s and installs from its configured sources.
#
# TORCH_INDEX_URL overrides the choice: a URL (for example
# https://download.pytorch.org/whl/cu126 for one CUDA version) is used in the
# same way, and "default" adds no index (torch from pip's configured
# sources: on PyPI, the CUDA build).

TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# torch_index_args GPU OVERRIDE_SET OVERRIDE: prints pip's index options for torch, one per line.
#   GPU: "yes" where an NVIDIA GPU is present (nvidia_gpu_present), else "no"
#   OVERRIDE_SET: "yes" where TORCH_INDEX_URL is set, else "no"
#   OVERRIDE: its value
# A pure function of its arguments; it reads nothing else.
torch_index_args() {
  local gpu=$1 override_set=$2 override=$3
  if [ "$override_set" = yes ]; then
    case "$override" in
      default) ;;
      http://* | https://* | file://*) printf '%s\n' --extra-index-url "$override" ;;
      *)
        echo "TORCH_INDEX_URL=$override is neither a URL nor 'default'; set it to an index URL such as $TORCH_CPU_INDEX, or to 'default' for pip's own sources" >&2
        return 2
        ;;
    esac
  elif [ "$gpu" = no ]; then
    printf '%s\n' --extra-index-url "$TORCH_CPU_INDEX"
  fi
}

# nvidia_gpu_present: exit 0 where this machine shows an NVIDIA GPU (the
# nvidia-smi tool or the device file /dev/nvidia0), else 1.
nvidia_gpu_present() {
  command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/nvidia0 ]
}
