# Source on the GPU machine (from the repo root), after bench/device_env.sh: switches the process to cuDNN 9.28
# (nvidia-cudnn-cu13 9.28.0.42) instead of the image's 9.19, for A/B runs of cuDNN's FP8 attention.
#
# The 517 MB wheel is over the 64 MiB a command may take along. Here, split it into ignored folders:
#   split -b 58M -d -a 1 nvidia_cudnn_cu13-9.28.0.42-py3-none-manylinux_2_27_x86_64.whl .cudN/cudnn.part
# (one piece per folder .cud0 .. .cud8), then send them in nine quick commands while the machine stays warm:
#   mkdir -p /root/cud && cp .cudN/* /root/cud/        (carry: .cudN)
# This file joins them, checks the sha256, unpacks the wheel into /tmp/cudnn928 and puts its libraries first
# on the loader's path, so PyTorch and the cuDNN frontend both load 9.28. CUDNN_FRONTEND_WHEEL, when set to a
# carried nvidia-cudnn-frontend wheel, also installs that frontend ahead of the one in /tmp/site.
if [ ! -f /tmp/cudnn928/.ready ]; then
  cat /root/cud/cudnn.part* > /tmp/cudnn928.whl
  echo "7358353c75bb121a58e5f7712fe6d588883dc1df8ba00f428237e44e97543c4d  /tmp/cudnn928.whl" | sha256sum -c \
    && python3 -c "import zipfile; zipfile.ZipFile('/tmp/cudnn928.whl').extractall('/tmp/cudnn928')" \
    && touch /tmp/cudnn928/.ready
fi
if [ -n "$CUDNN_FRONTEND_WHEEL" ] && [ ! -f /tmp/fe_new/.ready ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fe_new "$CUDNN_FRONTEND_WHEEL" \
    && touch /tmp/fe_new/.ready
fi
D=/tmp/cudnn928/nvidia/cudnn
export CUDNN_PATH=$D LD_LIBRARY_PATH=$D/lib:$LD_LIBRARY_PATH PYTHONPATH=/tmp/cudnn928:$PYTHONPATH
if [ -n "$CUDNN_FRONTEND_WHEEL" ]; then export PYTHONPATH=/tmp/fe_new:$PYTHONPATH; fi
