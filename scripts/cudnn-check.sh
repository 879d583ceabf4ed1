#!/usr/bin/env bash
# cuDNN SDPA check + bench on the GPU machine, with the system cuDNN and the
# pip one (PIP below), plus a torch cuDNN reference. Build first, here:
#   cargo build --release --example cudnn_check && cp target/release/examples/cudnn_check scripts/cudnn_torch_ref.py DIR/
# then run `bash DIR/cudnn-check.sh` there (OUT = folder for logs, default /tmp).
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
D=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp}
PIP=${PIP:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib}
LINK=/tmp/cudnn-pip-link; mkdir -p $LINK; ln -sf $PIP/libcudnn.so.9 $LINK/libcudnn.so
echo "=== system cuDNN ==="
timeout 170 $D/cudnn_check 2>&1 | tee $OUT/cudnn_system.txt
echo "=== pip cuDNN (UPIPE_CUDNN_LIB + libcudnn.so link) ==="
UPIPE_CUDNN_LIB=$PIP/libcudnn.so.9 LD_LIBRARY_PATH=$LINK:$PIP:$LD_LIBRARY_PATH timeout 170 $D/cudnn_check 2>&1 | tee $OUT/cudnn_pip.txt
echo "=== torch reference ==="
PY=/opt/torch/.venv/bin/python; [ -x $PY ] || PY=python3
PYTHONUNBUFFERED=1 timeout 60 $PY $D/cudnn_torch_ref.py 2>&1 | tee $OUT/cudnn_torch.txt
