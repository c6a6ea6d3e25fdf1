"""`VirtualCluster`: the slice of the Ray cluster a job runs on, reserved as placement groups.

One placement group per (virtual) node, `STRICT_PACK` so the bundles of a node stay on one
machine; each bundle is one worker slot: `{"CPU": cpus_per_bundle}` plus `{"GPU": 1}` with GPUs.
Worker groups put one actor on each bundle. Several groups may share the bundles (colocation,
e.g. policy training and generation on the same GPUs): each of their actors then asks for
`1 / max_colocated_worker_groups` of the bundle. Separate clusters give split placement.

Ray waits forever, silently, for a placement group it cannot place. Here a preflight compares
the request with the resources of the Ray cluster's live nodes first (`check_request_fits`) and
fails at once, with both numbers, when no placement can exist; only a request that may still be
met (resources held by other jobs, or nodes an autoscaler may add: `autoscaling=True`) waits, for
at most `placement_timeout_s`, and then ends with a `ClusterError` that says what was asked and
what exists. Modelled on NeMo-RL's `RayVirtualCluster`.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
import weakref
from typing import Any, Mapping, Sequence

import ray
import ray._private.state as ray_state
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from posttrain.distributed import cluster_reuse
from posttrain.distributed.worker_host import HostPool

logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The requested resources cannot be reserved (or a cluster is used after shutdown)."""


# VirtualClusters of this process that hold their reservation: what they hold stays taken while
# a later cluster of the same job (e.g. generation after policy) is placed.
_LIVE_CLUSTERS: "weakref.WeakSet[VirtualCluster]" = weakref.WeakSet()


def check_request_fits(
    groups: Sequence[Mapping[str, float]], node_capacity: Mapping[str, Mapping[str, float]]
) -> list[str]:
    """Problems that make a reservation impossible on these nodes; empty when it may fit.

    Args:
        groups: the resources of each placement group (one virtual node, all bundles summed);
            each must fit on one physical node (`STRICT_PACK`).
        node_capacity: per live node id, the resources left to this request (the node's total
            minus what this job already holds there).

    Checks, per resource: the sum over groups against the sum over nodes, and each group
    against the largest node; then places the groups largest first on the first node with room
    (exact for groups of equal size, the layout `make_cluster` produces). Pure: no Ray calls.
    """
    problems: list[str] = []
    keys = sorted({key for group in groups for key, value in group.items() if value > 0})
    for key in keys:
        asked = sum(group.get(key, 0.0) for group in groups)
        have = sum(node.get(key, 0.0) for node in node_capacity.values())
        if asked > have + 1e-9:
            problems.append(f"{key}: asked {asked:g}, the cluster has {have:g}")
    if problems:
        return problems
    for i, group in enumerate(groups):
        if not any(_fits(group, node) for node in node_capacity.values()):
            largest = {key: max((node.get(key, 0.0) for node in node_capacity.values()), default=0.0) for key in group}
            problems.append(
                f"node group {i} needs {_fmt(group)} on one machine; the largest node has {_fmt(largest)}"
            )
    if problems:
        return problems
    sizes = {tuple(sorted(group.items())) for group in groups}
    if len(sizes) == 1:  # equal groups: first fit is exact
        left = {node: dict(capacity) for node, capacity in node_capacity.items()}
        for i, group in enumerate(groups):
            node = next((n for n, capacity in left.items() if _fits(group, capacity)), None)
            if node is None:
                problems.append(
                    f"{len(groups)} node groups of {_fmt(group)} each (each on one machine): only {i} fit "
                    f"on the {len(node_capacity)} node(s)"
                )
                break
            for key, value in group.items():
                left[node][key] = left[node].get(key, 0.0) - value
    return problems


def placement_after_loss(
    group_needs: Sequence[Mapping[str, float]], group_nodes: Sequence[Sequence[str]],
    node_capacity: Mapping[str, Mapping[str, float]],
) -> tuple[list[int], list[str]]:
    """After nodes were lost: which node groups lost bundles, and why the live nodes cannot hold
    those groups again (empty when they can). Ray places such a group again by itself when there
    is room; this says at once, without waiting, whether there can be.

    Args:
        group_needs: the resources of each node group (placement group) of a cluster.
        group_nodes: the node id of each bundle of each group.
        node_capacity: per live node id, what is left there (`check_request_fits`); a node missing
            from it is lost.

    Pure: no Ray calls.
    """
    lost = [i for i, nodes in enumerate(group_nodes) if any(node not in node_capacity for node in nodes)]
    if not lost:
        return [], []
    return lost, check_request_fits([group_needs[i] for i in lost], node_capacity)


def _fits(need: Mapping[str, float], capacity: Mapping[str, float]) -> bool:
    return all(capacity.get(key, 0.0) + 1e-9 >= value for key, value in need.items())


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{key}: {value:g}" for key, value in sorted(resources.items())) + "}"


class VirtualCluster:
    """Reserve `bundles_per_node[i]` worker slots on each of `len(bundles_per_node)` nodes.

    Args:
        bundles_per_node: worker slots per node, e.g. `[2]` (one node, two workers) or `[8, 8]`.
        use_gpus: give each bundle one GPU (default False: CPU only).
        cpus_per_bundle: logical CPUs per bundle (default 1.0).
        max_colocated_worker_groups: how many worker groups may share each bundle (default 1).
            Each actor asks for `cpus_per_bundle / max_colocated_worker_groups` CPUs and, with
            GPUs, `1 / max_colocated_worker_groups` GPU.
        placement_timeout_s: how long to wait for a reservation that may still be met (resources
            held by other jobs, or by nodes still to join) before raising `ClusterError`
            (default 60.0). A request the live nodes cannot hold fails at once instead.
        name: prefix of the placement-group names, shown in Ray's tools and in errors.
        bundle_resources: extra Ray resources per bundle, e.g. `{"trainer": 1}` to place the
            workers only on nodes started with `ray start --resources '{"trainer": 8}'`
            (default None: none).
        autoscaling: the Ray cluster may add nodes (KubeRay / Ray autoscaler): a request larger
            than the live nodes waits up to `placement_timeout_s` instead of failing at once
            (default False).
        reuse_worker_processes: a worker group's processes, once it shut down cleanly, wait for
            the next members on their nodes (`worker_host.py`: no new interpreter, no imports
            again): this cluster's while it stands, or, with `cluster_reuse.reuse_clusters()` on,
            any cluster's or environment's in this process. CPU clusters only, for groups
            without `env_vars` or an isolated environment (default False: a job makes its groups
            once; for callers that make many short-lived groups, such as tests).

    Virtual nodes are steered to distinct physical nodes when there are enough of them (a soft
    hint to Ray), preferring nodes this job's other clusters do not use (so a separate generation
    cluster lands beside, not on, the policy's nodes), and share a physical node otherwise.
    """

    def __init__(
        self,
        bundles_per_node: list[int],
        use_gpus: bool = False,
        cpus_per_bundle: float = 1.0,
        max_colocated_worker_groups: int = 1,
        placement_timeout_s: float = 60.0,
        name: str = "",
        bundle_resources: Mapping[str, float] | None = None,
        autoscaling: bool = False,
        reuse_worker_processes: bool = False,
    ) -> None:
        if not bundles_per_node or any(int(n) != n or n < 1 for n in bundles_per_node):
            raise ValueError(f"bundles_per_node must be a non-empty list of positive ints, got {bundles_per_node!r}")
        if cpus_per_bundle <= 0:
            raise ValueError(f"cpus_per_bundle must be > 0, got {cpus_per_bundle}")
        if max_colocated_worker_groups < 1:
            raise ValueError(f"max_colocated_worker_groups must be >= 1, got {max_colocated_worker_groups}")
        bad = {key: value for key, value in (bundle_resources or {}).items() if key in ("CPU", "GPU") or value <= 0}
        if bad:
            raise ValueError(f"bundle_resources takes positive custom resources (not CPU / GPU), got {bad}")
        if not ray.is_initialized():
            raise ClusterError("Ray is not initialised: call posttrain.distributed.ray_utils.init_ray() first")
        self.bundles_per_node = [int(n) for n in bundles_per_node]
        self.use_gpus = use_gpus
        self.cpus_per_bundle = float(cpus_per_bundle)
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.placement_timeout_s = placement_timeout_s
        self.name = name or "cluster"
        self.bundle_resources = {key: float(value) for key, value in (bundle_resources or {}).items()}
        self.autoscaling = autoscaling
        # Where idle worker processes wait, when they are reused (None: they are not;
        # `worker_host.py`): the process's shared pool with clusters reused, else this cluster's.
        shared = cluster_reuse.process_pool() if reuse_worker_processes else None
        self._owns_worker_hosts = reuse_worker_processes and shared is None
        self.worker_hosts = HostPool() if self._owns_worker_hosts else shared
        # The shape under which a later job may take this cluster over (`cluster_reuse.py`; None:
        # `shutdown` releases it), and the worker groups placed on it that are not shut down yet.
        self.reuse_key: Any = None
        self._open_groups: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._uid = uuid.uuid4().hex[:8]
        cluster_reuse.release_idle()  # parked clusters must not stand in this reservation's way
        self._placement_groups: list[PlacementGroup] = self._reserve()
        self._bundle_node_ids = [placement_group_table(pg)["bundles_to_node_id"] for pg in self._placement_groups]
        _LIVE_CLUSTERS.add(self)

    # ------------------------------------------------------------------ reservation
    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_bundle}
        if self.use_gpus:
            bundle["GPU"] = 1.0
        bundle.update(self.bundle_resources)
        return bundle

    def _group_needs(self) -> list[dict[str, float]]:
        return [{key: value * count for key, value in self._bundle().items()} for count in self.bundles_per_node]

    def _preflight(self) -> None:
        """Fail at once when the live nodes cannot hold the request, whoever else uses them.

        Compared with each node's total resources minus what this job's other clusters already
        hold there. With `autoscaling` the shortfall is only logged: nodes may still join.
        """
        capacity = _node_capacity_left()
        problems = check_request_fits(self._group_needs(), capacity)
        if not problems:
            return
        held = _held_by_this_job()
        lines = [
            f"VirtualCluster {self.name!r}: the Ray cluster cannot hold this request "
            f"({len(self.bundles_per_node)} node group(s) of {self.bundles_per_node} bundles, each bundle "
            f"{_fmt(self._bundle())}, all bundles of a group on one machine):",
            *(f"  {problem}" for problem in problems),
            f"  asked in total: {_fmt(_sum(self._group_needs()))}; Ray cluster: {len(capacity)} live node(s), "
            f"total {_fmt(_plain(ray.cluster_resources(), self._bundle()))}"
            + (f", of which this job's other worker groups already hold {_fmt(held)}" if held else ""),
        ]
        for node in ray.nodes():
            if node["Alive"]:
                lines.append(f"  node {node['NodeManagerAddress']} ({node['NodeID'][:8]}): "
                             f"{_fmt(_plain(node['Resources'], self._bundle()))}")
        if self.autoscaling:
            logger.warning("%s\n  autoscaling: waiting up to %.0fs (cluster.placement_timeout_s) for nodes to join",
                           "\n".join(lines), self.placement_timeout_s)
            return
        lines.append("  Lower the workers / CPUs / GPUs asked for (policy.num_workers, cluster.*), add nodes, or set "
                     "cluster.autoscaling=true if an autoscaler adds nodes.")
        raise ClusterError("\n".join(lines))

    def _reserve(self) -> list[PlacementGroup]:
        self._preflight()
        targets = self._pick_target_nodes()
        groups = [
            placement_group(
                [self._bundle() for _ in range(count)],
                strategy="STRICT_PACK",
                name=f"{self.name}-{self._uid}-node{i}",  # names must be unique in the Ray namespace
                _soft_target_node_id=targets[i],
            )
            for i, count in enumerate(self.bundles_per_node)
        ]
        ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=self.placement_timeout_s)
        if len(ready) < len(groups):
            ready_flags = [pg.wait(timeout_seconds=0) for pg in groups]
            for pg in groups:
                remove_placement_group(pg)
            raise ClusterError(self._placement_failure_message(ready_flags))
        return groups

    def _pick_target_nodes(self) -> list[str | None]:
        """A distinct physical node per virtual node, greedily, among nodes with room for it.

        Ray's `STRICT_PACK` alone may put two small virtual nodes on the same machine; the hint
        spreads them. It is soft: if that node fills up meanwhile, Ray places the group elsewhere.
        """
        available = ray_state.available_resources_per_node()
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        others = {node for cluster in list(_LIVE_CLUSTERS) if cluster._placement_groups
                  for node in cluster.bundle_node_ids()}
        used: set[str] = set()
        targets: list[str | None] = []
        for need in self._group_needs():
            fits = [node for node in alive if node not in used and _fits(need, available.get(node, {}))]
            fits.sort(key=lambda node: node in others)  # stable: nodes free of this job's other groups first
            targets.append(fits[0] if fits else None)
            if fits:
                used.add(fits[0])
        return targets

    def _placement_failure_message(self, ready_flags: list[bool]) -> str:
        bundle = self._bundle()
        lines = [
            f"VirtualCluster {self.name!r}: placement groups not ready after {self.placement_timeout_s:.1f}s "
            "(placement_timeout_s / cluster.placement_timeout_s): "
            + ("the autoscaler has not added the nodes yet, or other jobs hold the resources."
               if self.autoscaling else "the live nodes could hold the request, so other jobs hold the resources."),
            f"  requested: {len(self.bundles_per_node)} node(s) with {self.bundles_per_node} bundles, "
            f"each bundle {bundle} (all bundles of a node on one machine); "
            f"total {self.world_size() * self.cpus_per_bundle:g} CPU"
            + (f", {self.world_size()} GPU" if self.use_gpus else ""),
            f"  placed: {sum(ready_flags)} of {len(ready_flags)} node groups",
            f"  Ray cluster total: {_plain(ray.cluster_resources(), bundle)}; "
            f"available: {_plain(ray.available_resources(), bundle)}",
        ]
        available = ray_state.available_resources_per_node()
        for node in ray.nodes():
            if node["Alive"]:
                node_id = node["NodeID"]
                lines.append(
                    f"  node {node['NodeManagerAddress']} ({node_id[:8]}): total {_plain(node['Resources'], bundle)}, "
                    f"available {_plain(available.get(node_id, {}), bundle)}"
                )
        lines.append("  Lower the bundles / CPUs / GPUs asked for, stop the other jobs, or add nodes to the Ray cluster.")
        return "\n".join(lines)

    # ------------------------------------------------------------------ queries
    def world_size(self) -> int:
        """Total number of bundles (worker slots)."""
        return sum(self.bundles_per_node)

    def bundle_locations(self) -> list[tuple[PlacementGroup, int]]:
        """`(placement_group, bundle_index)` of every bundle, in rank order (node by node)."""
        self._check_alive()
        return [(pg, i) for pg, count in zip(self._placement_groups, self.bundles_per_node) for i in range(count)]

    def bundle_node_ids(self) -> list[str]:
        """Physical Ray node id of every bundle, in rank order."""
        return [self._bundle_node_ids[n][i] for n, count in enumerate(self.bundles_per_node) for i in range(count)]

    def actor_resources(self) -> dict[str, float]:
        """Ray resources one actor of a colocated worker group asks for (its share of a bundle)."""
        share = {"num_cpus": self.cpus_per_bundle / self.max_colocated_worker_groups}
        if self.use_gpus:
            share["num_gpus"] = 1.0 / self.max_colocated_worker_groups
        return share

    def lost_node_problem(self) -> str | None:
        """Why this cluster's node groups on lost nodes cannot be placed again on the live nodes, in
        one line (`placement_after_loss`); None when no node was lost, when they can, or with
        `autoscaling` (nodes may still join)."""
        self._check_alive()
        lost, problems = placement_after_loss(self._group_needs(), [list(ids.values()) for ids in self._bundle_node_ids],
                                              _node_capacity_left())
        if not lost or not problems or self.autoscaling:
            return None
        return (f"VirtualCluster {self.name!r} lost node(s) {', '.join(self._lost_addresses(lost))} and the remaining "
                f"nodes cannot hold its {len(lost)} node group(s) there: {'; '.join(problems)}")

    def _lost_addresses(self, lost: list[int]) -> list[str]:
        nodes = ray.nodes()
        address = {node["NodeID"]: node["NodeManagerAddress"] for node in nodes}
        alive = {node["NodeID"] for node in nodes if node["Alive"]}
        return sorted({address.get(node, node[:8]) for i in lost for node in self._bundle_node_ids[i].values()
                       if node not in alive})

    def replace_lost_nodes(self) -> None:
        """After a node of this cluster was lost: wait (at most `placement_timeout_s`) until Ray has
        placed the node groups it held again on the live nodes (Ray does so by itself when there is
        room), or raise `ClusterError` at once when the live nodes cannot hold them
        (`lost_node_problem`). Nothing to do when no node was lost."""
        problem = self.lost_node_problem()
        if problem is not None:
            raise ClusterError(problem)
        lost, _ = placement_after_loss(self._group_needs(), [list(ids.values()) for ids in self._bundle_node_ids],
                                       _node_capacity_left())
        if not lost:
            return
        gone = self._lost_addresses(lost)
        deadline = time.monotonic() + self.placement_timeout_s
        while True:
            alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
            tables = [placement_group_table(pg) for pg in self._placement_groups]
            if all(t["state"] == "CREATED" and set(t["bundles_to_node_id"].values()) <= alive for t in tables):
                self._bundle_node_ids = [t["bundles_to_node_id"] for t in tables]
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"VirtualCluster {self.name!r} lost node(s) {', '.join(gone)}; Ray did not place its "
                                   f"{len(lost)} node group(s) again within {self.placement_timeout_s:g}s "
                                   "(cluster.placement_timeout_s)")
            time.sleep(0.2)

    def master_address_and_port(self, bundle: int = 0) -> tuple[str, int]:
        """IP of the node of `bundle` (default 0: rank 0) and a port free there now (rendezvous).
        Read here when the bundle is on this process's own node; elsewhere by a task on the bundle
        (which Ray runs in a worker process it may have to start: seconds of CPU for two numbers)."""
        if self.bundle_node_ids()[bundle] == ray.get_runtime_context().get_node_id():
            return _address_and_free_port()
        pg, bundle_index = self.bundle_locations()[bundle]
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index)
        # As long as a placement may take: the task may wait for a worker process to start there.
        return ray.get(_address_and_free_port_on_node.options(scheduling_strategy=strategy).remote(),
                       timeout=max(self.placement_timeout_s, 60.0))

    def group_started(self, group: Any) -> None:
        """`group` (a `WorkerGroup`) places workers on this cluster's bundles until `group_ended`."""
        self._open_groups.add(group)

    def group_ended(self, group: Any) -> None:
        self._open_groups.discard(group)

    def hosted_cpus(self, bundle: int, *, besides: Any = None) -> float:
        """CPUs of `bundle` that the open groups' members in reused processes take (Ray does not
        count them: such a process reserves nothing, `worker_host.py`), `besides` group left out."""
        return sum(group.hosted_cpus(bundle) for group in self.open_groups() if group is not besides)

    def open_groups(self) -> list[Any]:
        """The worker groups on this cluster that were not shut down."""
        return list(self._open_groups)

    def reservation_stands(self) -> bool:
        """Whether every placement group is still placed (False after `release`, or once Ray restarted)."""
        if not self._placement_groups or not ray.is_initialized():
            return False
        try:
            return all(placement_group_table(pg).get("state") == "CREATED" for pg in self._placement_groups)
        except Exception as error:  # noqa: BLE001 - a Ray that cannot answer holds nothing of ours
            logger.debug("placement_group_table failed: %s", error)
            return False

    def shutdown(self) -> None:
        """The job is done with this cluster: park it for the next job of its shape when clusters
        are reused (`cluster_reuse.py`), else `release` it. Idempotent."""
        if not cluster_reuse.keep(self):
            self.release()

    def release(self) -> None:
        """Release the placement groups (idempotent): Ray kills the actors placed in them, and the
        groups not shut down yet are shut down here, their members in reused processes too. The
        idle processes of a cluster's own pool are killed; those of the shared pool
        (`cluster_reuse.process_pool`) wait for the next cluster."""
        self.reuse_key = None
        for group in self.open_groups():
            group.shutdown(timeout_s=0.0)
        if self._owns_worker_hosts:
            self.worker_hosts.close()
        for pg in self._placement_groups:
            try:
                remove_placement_group(pg)
            except Exception as error:  # Ray already gone: nothing left to release
                logger.debug("remove_placement_group failed: %s", error)
        self._placement_groups = []
        _LIVE_CLUSTERS.discard(self)

    def _check_alive(self) -> None:
        if not self._placement_groups:
            raise ClusterError(f"VirtualCluster {self.name!r} was shut down")

    def __repr__(self) -> str:
        return (
            f"VirtualCluster(name={self.name!r}, bundles_per_node={self.bundles_per_node}, use_gpus={self.use_gpus}, "
            f"cpus_per_bundle={self.cpus_per_bundle}, max_colocated_worker_groups={self.max_colocated_worker_groups})"
        )


def _address_and_free_port() -> tuple[str, int]:
    """This node's IP and a port the OS says is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


_address_and_free_port_on_node = ray.remote(num_cpus=0)(_address_and_free_port)  # the same, as a task there


def _plain(resources: Mapping[str, Any], bundle: Mapping[str, float] | None = None) -> dict[str, float]:
    """CPU / GPU entries (and the custom resources of `bundle`) only: Ray also lists memory and
    one key per placement-group bundle, noise here."""
    keys = ("CPU", "GPU", *sorted(set(bundle or {}) - {"CPU", "GPU"}))
    return {key: resources[key] for key in keys if key in resources}


def _sum(groups: Sequence[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for group in groups:
        for key, value in group.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _held_by_this_job() -> dict[str, float]:
    """Resources the live VirtualClusters of this process reserved, summed."""
    return _sum([need for cluster in list(_LIVE_CLUSTERS) if cluster._placement_groups
                 for need in cluster._group_needs()])


def _node_capacity_left() -> dict[str, dict[str, float]]:
    """Per live node: its total resources minus what this job's live clusters hold there."""
    capacity = {node["NodeID"]: dict(node["Resources"]) for node in ray.nodes() if node["Alive"]}
    for cluster in list(_LIVE_CLUSTERS):
        if not cluster._placement_groups:
            continue
        for node_id in cluster.bundle_node_ids():
            for key, value in cluster._bundle().items():
                if node_id in capacity:
                    capacity[node_id][key] = capacity[node_id].get(key, 0.0) - value
    return capacity
