"""kvtier on Ray Serve: N engine replicas behind Ray's HTTP proxy, routed by prompt prefix.

    pip install 'kvtier[ray]'
    python tools/cluster/ray_serve.py --replicas 2 --host 127.0.0.1 --port 8000
    python tools/cluster/ray_serve.py --min-replicas 1 --max-replicas 4 \\
        --target-ongoing-requests 4 --max-batch 4

starts (or joins, with ``--address``) a Ray cluster, deploys
``actors.http.ray_serve.build_app`` (an ingress relaying to kvtier replicas
routed by Ray's ``PrefixCacheAffinityRouter``; ``--no-prefix-affinity``:
Ray's default router), prints ``kvtier: ready at http://HOST:PORT/v1`` and
serves until SIGINT/SIGTERM, then shuts Ray Serve down. ``--host`` and
``--port`` are Ray's proxy's; every other engine flag is ``kvtier serve``'s
and applies to each replica (docs/scale-out.md "Ray Serve").
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.engine.config import ConfigError, add_flags, config_from_flags


def parser() -> argparse.ArgumentParser:
    """The launcher's flags: replica count or autoscaling, routing, and ``kvtier serve``'s engine flags."""
    p = argparse.ArgumentParser(prog="ray_serve.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("Ray Serve")
    g.add_argument("--replicas", type=int, default=2, help="fixed replica count (default 2)")
    g.add_argument("--min-replicas", type=int, default=None,
                   help="autoscaling: fewest replicas (with --max-replicas)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling: most replicas (turns autoscaling on)")
    g.add_argument("--target-ongoing-requests", type=float, default=4.0,
                   help="autoscaling: requests in flight per replica Ray aims at (default 4)")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="num_cpus reserved per replica (default 1)")
    g.add_argument("--no-prefix-affinity", action="store_true",
                   help="Ray's default power-of-two router instead of PrefixCacheAffinityRouter")
    g.add_argument("--address", default=None,
                   help="an existing Ray cluster (ray.init address); default: start one here")
    add_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Deploy, print the URL, serve until a signal."""
    args = parser().parse_args(argv)
    try:
        config = config_from_flags(args)
    except ConfigError as exc:
        print(f"ray_serve.py: {exc}", file=sys.stderr)
        return 2
    autoscaling = None
    if args.max_replicas is not None:
        autoscaling = {"min_replicas": args.min_replicas or 1, "max_replicas": args.max_replicas,
                       "target_ongoing_requests": args.target_ongoing_requests}
    import ray
    from ray import serve

    from actors.http.ray_serve import RayServeSettings, build_app

    ray.init(address=args.address)
    serve.start(http_options={"host": config.host, "port": config.port})
    settings = RayServeSettings(config=config, replicas=args.replicas, autoscaling=autoscaling,
                                prefix_affinity=not args.no_prefix_affinity,
                                replica_cpus=args.replica_cpus)
    serve.run(build_app(settings), name="kvtier", route_prefix="/")
    print(f"kvtier: ready at http://{config.host}:{config.port}/v1", flush=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
