"""Serving ``/metrics``: a one-call HTTP endpoint, an ASGI app, and multi-process mode.

* A plain Python app: ``start_metrics_server(9400)`` serves the registry on a daemon thread and
  returns a ``MetricsServer`` to ``close()`` (or use it as a context manager).
* An existing ASGI server (FastAPI, Starlette, vLLM's API server): mount ``make_asgi_app()``.
* Several worker processes (gunicorn, uvicorn ``--workers``, vLLM ``--api-server-count``):
  prometheus_client's multi-process mode. Set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory
  *before* the processes start (prometheus_client reads it when it is first imported); each process
  then writes its samples to files there, and a scrape merges them. With ``registry=None`` both
  helpers here build that merging registry themselves when the variable is set. Wipe the directory
  between runs, and call ``mark_process_dead(pid)`` when a worker exits (gunicorn: ``child_exit``).

Example:
    >>> from prometheus_client import CollectorRegistry
    >>> with start_metrics_server(0, registry=CollectorRegistry()) as server:
    ...     server.url.startswith("http://127.0.0.1:")
    True
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client import multiprocess as _multiprocess

__all__ = [
    "MULTIPROC_DIR_ENV",
    "MetricsServer",
    "make_asgi_app",
    "mark_process_dead",
    "merged_registry",
    "multiprocess_dir",
    "multiprocess_registry",
    "scrape_registry",
    "start_metrics_server",
]

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    """The multi-process directory if prometheus_client's multi-process mode is on, else None.

    Example:
        >>> multiprocess_dir() is None or os.path.isdir(multiprocess_dir())
        True
    """
    return os.environ.get(MULTIPROC_DIR_ENV) or None


def multiprocess_registry(path: str | os.PathLike[str] | None = None) -> CollectorRegistry:
    """A fresh registry that merges every process's samples from ``path``.

    ``path`` defaults to ``$PROMETHEUS_MULTIPROC_DIR``. Serve this registry, never the global
    one, from a multi-process server: the global one holds only the serving process's values.

    Example:
        >>> import tempfile
        >>> registry = multiprocess_registry(tempfile.mkdtemp())
        >>> list(registry.collect())
        []
    """
    registry = CollectorRegistry()
    _multiprocess.MultiProcessCollector(registry, path=None if path is None else os.fspath(path))
    return registry


def scrape_registry(registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """The registry to serve: ``registry`` if given, else the multi-process one when
    ``PROMETHEUS_MULTIPROC_DIR`` is set, else prometheus_client's global ``REGISTRY``.

    Example:
        >>> mine = CollectorRegistry()
        >>> scrape_registry(mine) is mine
        True
    """
    if registry is not None:
        return registry
    if multiprocess_dir() is not None:
        return multiprocess_registry()
    return REGISTRY


class MetricsServer:
    """A running ``/metrics`` HTTP server (any path answers); ``close()`` stops it.

    Example:
        >>> server = start_metrics_server(0, registry=CollectorRegistry())
        >>> server.port > 0
        True
        >>> server.close()
    """

    def __init__(self, httpd: WSGIServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, release the port and wait for the server thread (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics_server(
    port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> MetricsServer:
    """Serve ``registry`` (see ``scrape_registry``) over HTTP on ``addr:port`` from a daemon thread.

    ``port=0`` picks a free port (read it from ``.port``). The default address is loopback:
    pass ``addr="0.0.0.0"`` to let a Prometheus server on another host scrape.

    Example:
        >>> with start_metrics_server(0, registry=CollectorRegistry()) as server:
        ...     server.host
        '127.0.0.1'
    """
    httpd, thread = prometheus_client.start_http_server(
        port, addr=addr, registry=scrape_registry(registry)
    )
    return MetricsServer(httpd, thread)


def make_asgi_app(registry: CollectorRegistry | None = None) -> Callable[..., Any]:
    """An ASGI app serving ``registry`` (see ``scrape_registry``) in the Prometheus text format.

    Example:
        >>> app = make_asgi_app(CollectorRegistry())
        >>> # FastAPI / Starlette: app_server.mount("/metrics", app)
        >>> callable(app)
        True
    """
    app: Callable[..., Any] = prometheus_client.make_asgi_app(registry=scrape_registry(registry))
    return app


class _Merged:
    """A collector yielding the families of several registries, in turn."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self._registries = registries

    def collect(self) -> Any:
        for registry in self._registries:
            yield from registry.collect()


def merged_registry(*registries: CollectorRegistry) -> CollectorRegistry:
    """One registry to serve that holds every family of ``registries`` (each registry once:
    the same one given twice is served once). The guarded server serves its guardrail metrics
    next to the process's default registry, where vLLM's own ``vllm:*`` series are, so one
    scrape has both, as ``vllm serve``'s has vLLM's.

    Example:
        >>> from prometheus_client import Counter
        >>> a, b = CollectorRegistry(), CollectorRegistry()
        >>> _ = Counter("a_total", "a", registry=a), Counter("b_total", "b", registry=b)
        >>> sorted(f.name for f in merged_registry(a, b, a).collect())
        ['a', 'b']
    """
    unique: list[CollectorRegistry] = []
    for registry in registries:
        if all(registry is not seen for seen in unique):
            unique.append(registry)
    merged = CollectorRegistry(auto_describe=False)
    merged.register(_Merged(unique))
    return merged


def mark_process_dead(pid: int, path: str | os.PathLike[str] | None = None) -> None:
    """Drop a dead worker's live gauges (in-flight, thresholds, build info) in multi-process mode.

    Call it from the process manager when a worker exits, e.g. gunicorn's ``child_exit`` hook:
    ``def child_exit(server, worker): mark_process_dead(worker.pid)``. Counters and histograms of
    the dead worker are kept: they still count what it served.

    Example:
        >>> import tempfile
        >>> mark_process_dead(12345, tempfile.mkdtemp())  # no files for that pid: nothing to do
    """
    _multiprocess.mark_process_dead(pid, None if path is None else os.fspath(path))
