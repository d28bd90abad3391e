"""Launch probe/p_dist_worker.py on 2 gloo ranks (CPU), as tests/test_distributed.py does."""
import os, socket, subprocess, sys, tempfile
here = os.path.dirname(os.path.abspath(__file__))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
out = tempfile.mkdtemp()
procs = [subprocess.Popen([sys.executable, os.path.join(here, sys.argv[1] if len(sys.argv) > 1 else "p_dist_worker.py")],
                          env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                                   CUDA_VISIBLE_DEVICES="", PROBE_OUT=out),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
for r, p in enumerate(procs):
    o = p.communicate(timeout=300)[0]
    print(f"===== rank {r} rc={p.returncode}\n" + "\n".join(l for l in o.splitlines() if "Warning" not in l and "warn" not in l))
