"""Connect to Ray for one command: an embedded local Ray, or an existing cluster by address."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import ray

from orch.plans.errors import OrchError, PlanError, Violation

GIB = 1024**3
CLIENT_ATTEMPTS = 3
"""Ray client sessions tried before giving up on a ``ray://`` address."""
CLIENT_RETRY_S = 2.0
"""Pause before the second attempt, doubled before each later one."""
LOOPBACK = "127.0.0.1"
"""Where every server of the embedded Ray listens: nothing of it is reachable from the network."""
_abandoned: list[threading.Thread] = []
"""Threads of :func:`ray_session_in_background` left to finish starting Ray and shut it down."""
_embedded_environment: dict[str, str] | None = None
"""The environment the embedded Ray this process started gave its worker processes (None: none
started, or Ray joined by address, whose workers' environment this process cannot see)."""


class RayConnectError(OrchError):
    """The declared Ray cluster cannot be reached."""


@contextlib.contextmanager
def ray_session(address: str | None, *, worker_cpus: float = 0, data_cpus: float = 0, object_store_gib: float = 1.0,
                connect_timeout_s: float = 30.0, worker_env: dict[str, str] | None = None,
                object_store: bool = False) -> Iterator[None]:
    """Yield with Ray connected; shut down only what this call started.

    An already-initialized Ray (a test fixture, a notebook) is used as it is. With no address an
    embedded Ray starts on loopback with at least ``worker_cpus + data_cpus`` logical CPUs, so a
    plan may run more workers than cores, and a capped object store (Ray would otherwise reserve
    ~30% of host memory). An address must answer within ``connect_timeout_s``
    (cluster.connect_timeout_s). ``data_cpus`` are what a streamed data source's own tasks take
    beside the workers': a cluster whose CPUs cannot hold both is refused (see
    :func:`require_data_cpus`).

    An embedded Ray's worker processes inherit this process's environment, plus ``worker_env``:
    actors then need no environment of their own (:func:`environment_to_ship`), and Ray gives
    them the workers it started beside its raylet instead of booting new ones. Credentials are
    not inherited (:func:`_credentials_withheld`), but for the object stores' when
    ``object_store`` says the run reads or writes one.
    """
    _wait_for_abandoned_sessions()
    if ray.is_initialized():
        require_data_cpus(worker_cpus, data_cpus)
        yield
        return
    with contextlib.ExitStack() as environment:
        try:  # a start interrupted half-way (Ctrl-C, SIGTERM) is shut down too
            if address is None:
                environment.enter_context(_inherited_by_workers({**embedded_ray_settings(), **(worker_env or {})}))
                with _credentials_withheld(object_store):
                    start_local_ray(num_cpus=max(os.cpu_count() or 1, int(worker_cpus + data_cpus + 0.999)),
                                    object_store_memory=int(object_store_gib * GIB))
            else:
                try:
                    connect(address, connect_timeout_s)
                except (ConnectionError, RuntimeError) as exc:
                    raise RayConnectError(
                        f"cluster.address={address}: cannot connect to a Ray cluster there ({exc}). Fix: start the "
                        "cluster (`ray start --head`), correct cluster.address, or set cluster.address=null for an "
                        "embedded local Ray") from exc
            require_data_cpus(worker_cpus, data_cpus)
            yield
        finally:
            ray.shutdown()


@contextlib.contextmanager
def _inherited_by_workers(worker_env: dict[str, str]) -> Iterator[None]:
    """``worker_env`` in this process's environment while the embedded Ray it starts lives.

    Ray's processes, the worker processes its raylet starts ahead of any request included, take
    the environment of the process that starts them. The variables are taken out again when the
    session ends, not as soon as Ray has started: removing a variable while another thread reads
    the whole environment (the command goes on checking the plan meanwhile) could fail that read.
    """
    global _embedded_environment
    saved = {name: os.environ.get(name) for name in worker_env}
    os.environ.update(worker_env)
    _embedded_environment = dict(os.environ)
    try:
        yield
    finally:
        _embedded_environment = None
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _credentials_withheld(object_store: bool) -> Iterator[None]:
    """Ray's processes started in the block get this process's environment less its credentials
    (:func:`orch.launchers.passthrough.withheld_from_workers`).

    The embedded Ray's servers, and through its raylet every worker process, take a copy of
    this process's environment when they start (the servers while ``ray.init`` runs); the
    command's own credentials (the tracking server's password, a cloud key) would otherwise sit
    in each worker, readable by any code the run imports and by whoever reads those processes'
    environments. Ray has no setting to leave variables out (a runtime_env only adds them), and
    the command's other thread goes on using them meanwhile (opening the tracking store), so they
    stay in this process and are left out where Ray starts a process: its ``services.ConsolePopen``.
    """
    from ray._private import services

    from orch.launchers.passthrough import withheld_from_workers

    started_with = services.ConsolePopen

    class WithoutCredentials(started_with):
        def __init__(self, *args, env: dict[str, str] | None = None, **kwargs):
            if env is not None:
                env = {name: value for name, value in env.items()
                       if not withheld_from_workers(name, object_store=object_store)}
            super().__init__(*args, env=env, **kwargs)

    global _embedded_environment
    if _embedded_environment is not None:  # what the workers will have, for environment_to_ship
        _embedded_environment = {name: value for name, value in _embedded_environment.items()
                                 if not withheld_from_workers(name, object_store=object_store)}
    services.ConsolePopen = WithoutCredentials
    try:
        yield
    finally:
        services.ConsolePopen = started_with


def environment_to_ship(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` that Ray's worker processes do not already have, for an actor's runtime_env.

    Workers of the embedded Ray this process started have its environment; those of a cluster
    joined by address get all of ``env``. An actor given environment variables gets a worker
    process of its own, started on demand, instead of one of those Ray has already started:
    about a second more before it answers, and CPU time spent twice.
    """
    inherited = _embedded_environment
    if inherited is None:
        return dict(env)
    return {name: value for name, value in env.items() if inherited.get(name) != value}


class RaySessionHandle:
    """The command's side of :func:`ray_session_in_background`: wait for Ray, and let it go.

    Called (``handle()``), it returns once Ray is connected and raises what connecting raised
    (``handle(wait=False)`` returns False at once while Ray is still starting). Called in the
    main thread once Ray is connected, it puts the program's SIGTERM handler back over the one
    Ray's core worker installs. :meth:`release` tells the session's thread the command is done
    with Ray: it shuts Ray down while the command finishes what needs no Ray (logging the
    trained model, the plots): an embedded Ray takes seconds to stop, one process at a time.
    """

    def __init__(self, connected: concurrent.futures.Future, leave: threading.Event, started_line: _HeldRecords):
        self._connected, self._leave, self._started_line = connected, leave, started_line

    def __call__(self, wait: bool = True) -> bool:
        if self._leave.is_set():
            raise RuntimeError("Ray was released by this command; it is shutting down")
        if not wait and not self._connected.done():
            return False
        self._connected.result()
        self._started_line.release()
        # Ray's core worker installs a native SIGTERM handler (it logs and aborts) over the
        # program's, which only the main thread can put back (as :func:`_init_keeping_sigterm` does).
        if threading.current_thread() is threading.main_thread() and callable(
                handler := signal.getsignal(signal.SIGTERM)):
            signal.signal(signal.SIGTERM, handler)
        return True

    def release(self) -> None:
        """Nothing more of this command uses Ray: start its shutdown now (the block's end waits for it)."""
        self._leave.set()


@contextlib.contextmanager
def ray_session_in_background(address: str | None, **session) -> Iterator[RaySessionHandle]:
    """:func:`ray_session`, held by a thread of its own, so the command can do other work (check
    the model, create its MLflow run) during the seconds Ray's server processes take to start.

    Yields a :class:`RaySessionHandle`. Ray's "Started a local Ray instance" line is held back
    until it is first called: a command that refuses its input before it uses Ray shows the
    refusal alone. When the block ends, or earlier at :meth:`RaySessionHandle.release`, Ray is
    shut down by the thread, which holds the session until then: Ray ties the processes it
    starts to the life of the thread that started them (the kernel's parent-death signal), so
    the thread must outlive the session. A block that fails while Ray is still starting does
    not wait for it (:func:`_abandon`).
    """
    connected: concurrent.futures.Future = concurrent.futures.Future()
    leave = threading.Event()
    started_line = _HeldRecords(logging.getLogger("ray._private.worker"), "Started a local Ray instance")

    def hold() -> None:
        try:
            with ray_session(address, **session):
                connected.set_result(None)
                leave.wait()
        except BaseException as error:  # noqa: BLE001 - handed to the command's thread by the handle
            if not connected.done():
                connected.set_exception(error)
        finally:
            # The session is over (or never began): a start line not released by then stays unshown.
            started_line.drop()

    holder = threading.Thread(target=hold, name="ray-session", daemon=True)
    holder.start()
    failed = True
    try:
        yield RaySessionHandle(connected, leave, started_line)
        failed = False
    finally:
        leave.set()
        if failed and not connected.done():
            _abandon(holder)
        else:
            holder.join()


def _abandon(holder: threading.Thread) -> None:
    """Let a command that fails while its Ray is still starting go on without waiting for Ray.

    A refused model or tracking store would otherwise wait seconds for a start nobody uses,
    then for its shutdown, before its error is even shown. The thread goes on: it finishes
    starting Ray and shuts it down; the next session in this process waits for that, and so
    does the interpreter's exit, before Ray's own exit hook and before the interpreter tears
    its modules down under the thread (which a half-started Ray does not survive: gRPC
    aborts the process).
    """
    _abandoned.append(holder)
    if len(_abandoned) == 1:
        atexit.register(_wait_for_abandoned_sessions)


def _wait_for_abandoned_sessions() -> None:
    while _abandoned:
        _abandoned.pop().join()


class _HeldRecords(logging.Filter):
    """Holds back ``logger``'s records whose message starts with ``start`` until :meth:`release`
    emits them (or :meth:`drop` discards them); later ones pass straight through."""

    def __init__(self, logger: logging.Logger, start: str):
        super().__init__()
        self.logger, self.start, self.records = logger, start, []
        logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(self.start):
            self.records.append(record)
            return False
        return True

    def release(self) -> None:
        self.drop()
        for record in self.records:
            self.logger.handle(record)
        self.records = []

    def drop(self) -> None:
        self.logger.removeFilter(self)


def require_data_cpus(worker_cpus: float, data_cpus: float) -> None:
    """Refuse a cluster whose CPUs cannot hold the workers and the data's tasks together.

    The workers' placement waits for CPUs (an autoscaler may add them), but a streamed source's
    tasks on a cluster with no CPU beside the workers' would never be scheduled: Ray Data waits
    for them for ever, with the workers blocked on their first batch.
    """
    total = ray.cluster_resources().get("CPU", 0.0)
    if data_cpus and total < worker_cpus + data_cpus:
        raise PlanError([Violation(
            "data.cpus_per_task", data_cpus,
            f"the data's tasks take {data_cpus:g} CPU(s) beside the workers' {worker_cpus:g}, but the cluster has "
            f"{total:g} CPU(s) in all.",
            (f"lower data.cpus_per_task to {total - worker_cpus:g} or less, or add a node with CPUs"
             if total > worker_cpus else "add a node with CPUs beside the workers' (an autoscaling cluster: start its "
             "nodes first), or lower cluster.cpus_per_worker"))])


def start_local_ray(**init_kwargs) -> None:
    """``ray.init`` of an embedded Ray whose GCS, raylet, agents and workers all listen on loopback.

    Token authentication stays as Ray sets it for a new local cluster (on, unless the user set
    ``RAY_AUTH_MODE``); the dashboard, which would serve HTTP, is not started.
    """
    with _loopback_node_address():
        _init_keeping_sigterm(address="local", _node_ip_address=LOOPBACK, include_dashboard=False, **init_kwargs)


def embedded_ray_settings() -> dict[str, str]:
    """Ray settings (``RAY_<name>`` variables, which its processes read at start) of an embedded Ray.

    Its workers start at nice 0, not Ray's 15 (``RAY_worker_niceness``): they are the training
    ranks, the one job this Ray runs. At nice 15 every wake-up of the driver, the raylet or the
    GCS preempts a rank on a node with a core per rank, and the other ranks wait for it at the
    next collective: on 2-core CPU workers that cost several percent of every step against the
    same ranks under torchrun (``bench/overhead_vs_deepspeed.py``). Its processes keep no records
    that only a dashboard or Ray's state API reads, since an embedded Ray has neither: no Ray
    metrics (``RAY_enable_metrics_collection``: its dashboard agent spent 1% of a core exporting
    them), no task events (``RAY_task_events_report_interval_ms=0``, what ``ray list tasks`` and
    ``ray timeline`` read; Ray's config says it is for observability only), no per-handler event
    loop statistics (``RAY_event_stats``). The last two took about a sixth of the CPU an idle
    embedded Ray with two actors uses. A user's own value of any of them wins; a cluster started
    with ``ray start`` keeps its own.
    """
    defaults = {"RAY_worker_niceness": "0", "RAY_enable_metrics_collection": "0",
                "RAY_task_events_report_interval_ms": "0", "RAY_event_stats": "0"}
    return {name: value for name, value in defaults.items() if name not in os.environ}


@contextlib.contextmanager
def _loopback_node_address() -> Iterator[None]:
    """Let ``ray.init(_node_ip_address="127.0.0.1")`` keep that address.

    Ray's servers listen on loopback only when the node's address is loopback, and otherwise
    on all interfaces. On Linux, Ray replaces a loopback node address with the machine's routable
    one (``services.resolve_ip_for_localhost``), so that other nodes could join; it keeps
    loopback where it does not support clusters (macOS, Windows), a switch it reads once at
    import (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``). A local run never takes other nodes, so the
    switch is off while the node starts; the processes it starts get the address explicitly.
    """
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _init_keeping_sigterm(**init_kwargs) -> None:
    """``ray.init``, leaving a SIGTERM handler the program installed in place.

    ``ray.init`` installs its own handler (``sys.exit`` from wherever the main thread is), which
    would skip the command's cleanup; a program that installed a Python handler keeps it. With
    no such handler (a library use), Ray's stays.
    """
    if threading.current_thread() is not threading.main_thread():
        # Ray installs no handler from another thread, and warns that it did not.
        with _without_log(logging.getLogger("ray._private.worker"), "SIGTERM handler is not set"):
            ray.init(**init_kwargs)
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(**init_kwargs)
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _without_log(logger: logging.Logger, start: str) -> Iterator[None]:
    """``logger``'s records whose message starts with ``start`` dropped while the block runs."""
    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(start)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def connect(address: str, timeout_s: float) -> None:
    """Join the cluster at ``address`` ('auto', 'host:port' or 'ray://host:port') within ``timeout_s``.

    Ray's own connection retries add up to about 14 minutes for a GCS address that does not
    answer, and print a warning every few seconds. The address is first probed with one gRPC
    call bounded by ``timeout_s`` (silent, and nothing to clean up when it is abandoned); Ray
    connects only to a server that answered.
    """
    if not timeout_s > 0:
        raise RayConnectError(f"cluster.connect_timeout_s={timeout_s}: must be more than 0 seconds. Fix: set "
                              "cluster.connect_timeout_s=30 (the default), or more for a slow network")
    if address.startswith("ray://"):
        _probe_client_server(address, timeout_s)
        _init_client(address)
        return
    gcs = _gcs_address(address)
    _probe_gcs(address, gcs, timeout_s)
    _init_keeping_sigterm(address=gcs)


def _gcs_address(address: str) -> str:
    """``host:port`` of the cluster's GCS, as Ray would find it ('auto': the last `ray start` here).

    For 'auto' the record of the last `ray start` comes first (unless ``RAY_ADDRESS`` is set), as
    `ray start` tells its user. Ray itself prefers the one Ray process it finds running on this
    machine, when there is exactly one, over that record: that could be another run's embedded
    Ray, which is no cluster to join. With none recorded, Ray's search of the running ones decides.
    """
    from ray._private.services import canonicalize_bootstrap_address, find_bootstrap_address

    recorded = find_bootstrap_address(None) if address == "auto" and not os.environ.get("RAY_ADDRESS") else None
    try:
        return canonicalize_bootstrap_address(recorded or address)
    except ConnectionError as exc:  # 'auto' and no cluster started on this machine
        raise RayConnectError(
            f"cluster.address={address}: no running Ray cluster found on this machine ({exc}). Fix: start one "
            "(`ray start --head`), give its address as cluster.address=HOST:PORT, or set "
            "cluster.address=null for an embedded local Ray") from None
    except ValueError as exc:
        raise RayConnectError(
            f"cluster.address={address}: not a Ray address ({exc}). Fix: use HOST:PORT of the head's GCS "
            "(6379 unless `ray start --port` chose another), ray://HOST:10001 for the Ray client server, "
            "'auto', or null for an embedded local Ray") from None


def _probe_gcs(address: str, gcs: str, timeout_s: float) -> None:
    """One call to the GCS at ``gcs``, waiting up to ``timeout_s`` for it to answer.

    The channel is Ray's own (its TLS settings and auth token), so a refused token is told
    apart from a server that is not there.
    """
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = init_grpc_channel(gcs)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, wait_for_ready=True)
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise RayConnectError(_token_refused(address, gcs, error.details())) from None
        raise RayConnectError(_unreachable(address, gcs, timeout_s, error.code().name)) from None
    finally:
        channel.close()


def _probe_client_server(address: str, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the Ray client server at ``ray://host:port`` to answer a ping.

    A channel that opens proves little: a firewall, a load balancer or a proxy in front of the
    port accepts it, and Ray's client then retries its own ping for about 30 seconds whatever
    the timeout. The probe sends that ping (the one Ray's client sends first, answered by the
    head's proxy before any session starts), bounded by ``timeout_s``.
    """
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

    channel = init_grpc_channel(address.removeprefix("ray://"))
    try:
        ping = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
        ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=timeout_s, wait_for_ready=True)
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise RayConnectError(
                f"cluster.address={address}: a server answered there, but not as Ray's client server does "
                f"({error.code().name}: {error.details()}); the port may be the head's GCS port (write it without "
                "ray://) or a proxy's. Fix: cluster.address=ray://HOST:10001 (the head's "
                "--ray-client-server-port), or HOST:PORT of the GCS (6379 unless `ray start --port` chose another)"
            ) from None
        raise RayConnectError(_unreachable(address, address, timeout_s, error.code().name)) from None
    finally:
        channel.close()


def _unreachable(address: str, target: str, timeout_s: float, detail: str) -> str:
    return (f"cluster.address={address}: no Ray cluster answered at {target} within "
            f"cluster.connect_timeout_s={timeout_s:g}s ({detail}). Check that the cluster is running (`ray status` "
            "on its head node), that host and port are right (HOST:PORT of the head's GCS, 6379 unless "
            "`ray start --port` chose another, or ray://HOST:10001 for the Ray client server) and that no "
            "firewall blocks the port; raise cluster.connect_timeout_s on a slow network, or set "
            "cluster.address=null for an embedded local Ray")


def _token_refused(address: str, gcs: str, detail: str) -> str:
    return (f"cluster.address={address}: the Ray cluster at {gcs} refused this machine's auth token ({detail}). "
            "Fix: copy the head node's ~/.ray/auth_token here, or point RAY_AUTH_TOKEN_PATH at it")


def _init_client(address: str) -> None:
    """``ray.init(address)`` for a ``ray://`` address, tried up to CLIENT_ATTEMPTS times.

    A Ray client session runs in a server process the head starts for each connection. When that
    process dies before the client reaches it (seen here when a session server left from an
    earlier cluster still held the port), Ray reports "Initialization failure from server" and
    gives up, although the next session, started on the next free port, usually works. Ray's own
    retries cover only reaching the head's proxy, not this.
    """
    pause_s = CLIENT_RETRY_S
    for attempt in range(1, CLIENT_ATTEMPTS + 1):
        try:
            _init_keeping_sigterm(address=address)
            return
        except ConnectionAbortedError as exc:
            if attempt == CLIENT_ATTEMPTS:
                raise
            cause = str(exc).strip().splitlines()[-1]
            print(f"warning: {address}: the cluster could not start a client session (attempt {attempt} of "
                  f"{CLIENT_ATTEMPTS}: {cause}); retrying in {pause_s:.0f}s", file=sys.stderr, flush=True)
            time.sleep(pause_s)
            pause_s *= 2
