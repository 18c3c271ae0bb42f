"""`unispec serve --replicas N`: the same FastAPI app on Ray Serve replicas, one LLM per replica.

    client ─HTTP─▶ Ray Serve proxy (host:port) ─router─▶ replica 1 … N   (each: serve_app over its own LLM)

Ray's router sends each request to a replica with few requests in flight (power of two choices), so
each replica's continuous batch stays full. `--max-replicas M` lets Ray Serve autoscale between N and M
replicas, aiming at `max_batch_size` requests in flight per replica. A replica asks Ray for
`--cpus-per-replica` CPUs and `--gpus-per-replica` GPUs (default 1 with `--backend trt`, else 0): Ray
places replicas on nodes with those resources free and sets CUDA_VISIBLE_DEVICES of each, so with one
GPU per replica, N replicas take N GPUs.

Where: with RAY_ADDRESS set (e.g. `ray://head:10001` or `head:6379`) the app is deployed on that cluster,
whose nodes must all see the artifact directory at the same path; without it a local Ray cluster is
started for this process and stopped with it. Ray's own CLI works too, through `app_builder`:

    serve run unispec.serve_ray:app_builder artifact_dir=artifacts/dflash replicas=2
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from runtime.errors import BackendUnavailableError, UnispecError
from unispec.serve import ServeConfig, load_model

__all__ = ["app_builder", "deployment", "run_on_ray"]

APP_NAME = "unispec"


def _ray_serve() -> Any:
    try:
        from ray import serve
    except ImportError:
        raise BackendUnavailableError("--replicas needs Ray Serve; pip install -e '.[serve]' (or 'ray[serve]')") \
            from None
    return serve


def deployment_options(config: ServeConfig, max_batch_size: int | None = None) -> dict[str, Any]:
    """Ray Serve options: fixed replicas, or autoscaling bounds; each replica's resources."""
    per_replica = config.max_batch_size or max_batch_size or 16
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": config.cpus_per_replica, "num_gpus": config.replica_gpus},
        # beyond a full batch, requests wait in the replica's own queue (FIFO for a batch slot)
        "max_ongoing_requests": 4 * per_replica,
    }
    if config.max_replicas is None:
        options["num_replicas"] = config.replicas
    else:
        options["autoscaling_config"] = {"min_replicas": config.replicas, "max_replicas": config.max_replicas,
                                         "target_ongoing_requests": per_replica}
    return options


def deployment(config: ServeConfig) -> Any:
    """The bound Ray Serve application: `serve.run(deployment(config))`."""
    serve = _ray_serve()

    @serve.ingress()
    class UnispecReplica:
        """One replica: loads its LLM, then Ray Serve asks it for the ASGI app to serve."""

        def __init__(self, replica_config: ServeConfig) -> None:
            self.model = load_model(replica_config)

        def __serve_build_asgi_app__(self) -> Any:
            from unispec.serve_app import build_app

            return build_app(self.model)

    # the class is built here, so a driver without Ray never imports it
    options = deployment_options(config, _artifact_batch_size(config))
    return serve.deployment(UnispecReplica, name=APP_NAME, **options).bind(config)


def _artifact_batch_size(config: ServeConfig) -> int | None:
    """The artifact's max_batch_size when the driver can read it (a cluster's driver may not see it)."""
    from runtime.manifest import Manifest

    try:
        bound = Manifest.load(config.artifact_dir).max_batch_size
    except (UnispecError, OSError):
        return None
    if config.max_batch_size is not None and config.max_batch_size > bound:   # fail here, not in N replicas
        raise UnispecError(f"--max-batch-size {config.max_batch_size} is above this artifact's max_batch_size "
                           f"{bound}; lower it or re-export with `unispec export --max-batch-size`")
    return bound


def app_builder(args: dict[str, str]) -> Any:
    """For Ray's CLI: `serve run unispec.serve_ray:app_builder artifact_dir=DIR [replicas=N ...]`
    (keys are ServeConfig's fields; host and port are Ray Serve's own, from its config)."""
    types = {f.name: f.type for f in fields(ServeConfig)}
    unknown = sorted(set(args) - set(types))
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; use ServeConfig fields: {', '.join(types)}")
    config = ServeConfig(artifact_dir=Path(args["artifact_dir"]))
    cast = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true", "yes"), "str": str}
    values = {k: _cast(types[k], v, cast) for k, v in args.items() if k != "artifact_dir"}
    return deployment(replace(config, **values))


def _cast(annotation: str, value: str, cast: dict[str, Any]) -> Any:
    for name, fn in cast.items():
        if annotation.startswith(name):
            return fn(value)
    return Path(value) if "Path" in annotation else value


def run_on_ray(config: ServeConfig) -> None:
    """Deploy on the RAY_ADDRESS cluster (or a local one), serve on config.host:port until interrupted."""
    import ray

    serve = _ray_serve()
    app = deployment(config)                 # checks what the driver can before starting anything
    address = os.environ.get("RAY_ADDRESS") or None
    ray.init(address=address, include_dashboard=False, logging_level=config.log_level.upper())
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except Exception as exc:             # e.g. a replica's LLM refused the artifact; Ray logged why above
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UnispecError(f"Ray Serve could not deploy {config.model_name} ({first}); the replicas' errors "
                               "are in the log above") from None
        # SIGTERM must reach the finally below too (Python's default would leave the local cluster running)
        signal.signal(signal.SIGTERM, _interrupt)
        print(f"unispec serve: {config.model_name} on Ray Serve ({_replicas(config)}) at "
              f"http://{config.host}:{config.port}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if address:
            serve.delete(APP_NAME)           # a shared cluster keeps running; only this app goes
        else:
            serve.shutdown()
        ray.shutdown()                       # and a local cluster goes with this process


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _replicas(config: ServeConfig) -> str:
    if config.max_replicas is None:
        return f"{config.replicas} replica{'s' if config.replicas > 1 else ''}"
    return f"{config.replicas} to {config.max_replicas} replicas"
