"""Run a 4-process benchmark as two nodes of 2 joined by a slow link (Linux, root).

Two network namespaces joined by a veth pair, each end shaped to `--rate` by a token
bucket (`tc qdisc ... tbf`: this machine's kernel has no netem qdisc, so no added
delay; the veth's own latency is a few microseconds); one torchrun agent per namespace (static rendezvous: node 0
holds ranks 0-1, node 1 ranks 2-3), gloo bound to the veth ends. The processes of a
node reach each other over their namespace's own routes, unshaped. The benchmark
script finds its node's link in AUTOPAR_BENCH_LINK. Everything is removed afterwards.

    sudo python benchmarks/slow_link.py --rate 1gbit -- benchmarks/hierarchical_vs_ddp.py ...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

PREFIX = "apbench"
ROOT = Path(__file__).resolve().parent.parent


def sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def set_up(rate: str) -> None:
    tear_down()
    sh("ip", "link", "add", f"{PREFIX}v0", "type", "veth", "peer", "name", f"{PREFIX}v1")
    for k in (0, 1):
        ns, dev = f"{PREFIX}{k}", f"{PREFIX}v{k}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"10.77.0.{k + 1}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
           "burst", "256kb", "latency", "100ms")


def tear_down() -> None:
    for k in (0, 1):
        sh("ip", "netns", "del", f"{PREFIX}{k}", check=False)
    sh("ip", "link", "del", f"{PREFIX}v0", check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="the link's rate, each direction")
    parser.add_argument("--port", type=int, default=29631)
    parser.add_argument("script", nargs=argparse.REMAINDER,
                        help="-- the benchmark script and its arguments")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    set_up(args.rate)
    try:
        agents = []
        for k in (0, 1):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                   "GLOO_SOCKET_IFNAME": f"{PREFIX}v{k}", "AUTOPAR_BENCH_LINK": f"{PREFIX}v{k}",
                   "AUTOPAR_BENCH_RATE": f"{args.rate} each way (tbf)"}
            agents.append(subprocess.Popen(
                ["ip", "netns", "exec", f"{PREFIX}{k}", sys.executable, "-m",
                 "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                 "--node-rank", str(k), "--master-addr", "10.77.0.1", "--master-port",
                 str(args.port), *script], env=env))
        codes = [a.wait() for a in agents]
    finally:
        tear_down()
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
