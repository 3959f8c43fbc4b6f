#!/bin/bash
# One lane of gpu_lanes.sh, run inside its own PID, network and mount namespaces: bring up loopback (the
# host name resolves to 127.0.0.1 on the device machine), give Ray a /tmp/ray of its own and the compile
# caches a folder of their own, then run the lane's command.
python3 - <<'PY'  # `ip link set lo up` without iproute2: SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
PY
addr=$(python3 -c "import socket; print(socket.gethostbyname(socket.gethostname()))" 2>/dev/null)
mkdir -p /tmp/ray && mount --bind "$LANE/ray" /tmp/ray
[ -f /tmp/oppo-gpu-env.sh ] && source /tmp/oppo-gpu-env.sh
export NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo VLLM_HOST_IP=${addr:-127.0.0.1}
export VLLM_CACHE_ROOT=$LANE/cache/vllm TRITON_CACHE_DIR=$LANE/cache/triton TORCHINDUCTOR_CACHE_DIR=$LANE/cache/inductor
echo "lane on GPUs $CUDA_VISIBLE_DEVICES, address ${addr:-none}, $(date)"
bash -c "$1"
echo "lane done rc=$? $(date)"
