# Source on the GPU machine (from the repo root): installs the carried wheels (.whl/) and, when the
# Transformer Engine pieces were sent (/root/tec) with .tew carried, builds and installs TE 2.20.2.
# The TE pieces: the core wheel split in parts (/root/tec/tecore.part*, checked against its sha256 below) and the
# transformer_engine_torch source and wheels in .tew/.
D=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn
export PYTHONPATH=/tmp/site CUDNN_PATH=$D LD_LIBRARY_PATH=$D/lib PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -f /tmp/site/.wheels-ready ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.wheels-ready
fi
if [ -d .tew ] && ls /root/tec/tecore.part* >/dev/null 2>&1 && [ ! -f /tmp/site/.te-ready ]; then
  core=/root/tec/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
  cat /root/tec/tecore.part* > "$core"
  echo "30063d3699e779cce63617c3458804f7a504ce8279f2749c98313db9daae273e  $core" | sha256sum -c
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$core" .tew/*.whl
  CPLUS_INCLUDE_PATH=$(ls -d /opt/torch/.venv/lib/python3.12/site-packages/nvidia/*/include | tr '\n' ':')
  export CPLUS_INCLUDE_PATH
  mkdir -p /tmp/tebuild && tar xzf .tew/transformer_engine_torch-2.20.2.tar.gz -C /tmp/tebuild
  (cd /tmp/tebuild/transformer_engine_torch-2.20.2 && NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 \
     MAX_JOBS=16 python3 -m pip wheel -q --no-build-isolation --no-deps -w /tmp/tew .)
  python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('/tmp/tew/*.whl')[0]).extractall('/tmp/site')"
  python3 -c "import transformer_engine.pytorch as te; print('TE', te.is_fp8_available(return_reason=True))" \
    && touch /tmp/site/.te-ready
fi
