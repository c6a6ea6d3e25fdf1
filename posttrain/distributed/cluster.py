"""`VirtualCluster`: the slice of the Ray cluster a job runs on, reserved as placement groups.

One placement group per (virtual) node, `STRICT_PACK` so the bundles of a node stay on one
machine; each bundle is one worker slot: `{"CPU": cpus_per_bundle}` plus `{"GPU": 1}` with GPUs.
Worker groups put one actor on each bundle. Several groups may share the bundles (colocation,
e.g. policy training and generation on the same GPUs): each of their actors then asks for
`1 / max_colocated_worker_groups` of the bundle. Separate clusters give split placement.

Ray waits forever, silently, for a placement group it cannot place; here the wait is bounded by
`placement_timeout_s` and ends with a `ClusterError` that says what was asked and what exists.
Modelled on NeMo-RL's `RayVirtualCluster`.
"""

from __future__ import annotations

import logging
import socket
import uuid
from typing import Any

import ray
import ray._private.state as ray_state
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The requested resources cannot be reserved (or a cluster is used after shutdown)."""


class VirtualCluster:
    """Reserve `bundles_per_node[i]` worker slots on each of `len(bundles_per_node)` nodes.

    Args:
        bundles_per_node: worker slots per node, e.g. `[2]` (one node, two workers) or `[8, 8]`.
        use_gpus: give each bundle one GPU (default False: CPU only).
        cpus_per_bundle: logical CPUs per bundle (default 1.0).
        max_colocated_worker_groups: how many worker groups may share each bundle (default 1).
            Each actor asks for `cpus_per_bundle / max_colocated_worker_groups` CPUs and, with
            GPUs, `1 / max_colocated_worker_groups` GPU.
        placement_timeout_s: how long to wait for the reservation before raising `ClusterError`
            (default 60.0).
        name: prefix of the placement-group names, shown in Ray's tools and in errors.

    Virtual nodes are steered to distinct physical nodes when there are enough of them (a soft
    hint to Ray), and share a physical node otherwise.
    """

    def __init__(
        self,
        bundles_per_node: list[int],
        use_gpus: bool = False,
        cpus_per_bundle: float = 1.0,
        max_colocated_worker_groups: int = 1,
        placement_timeout_s: float = 60.0,
        name: str = "",
    ) -> None:
        if not bundles_per_node or any(int(n) != n or n < 1 for n in bundles_per_node):
            raise ValueError(f"bundles_per_node must be a non-empty list of positive ints, got {bundles_per_node!r}")
        if cpus_per_bundle <= 0:
            raise ValueError(f"cpus_per_bundle must be > 0, got {cpus_per_bundle}")
        if max_colocated_worker_groups < 1:
            raise ValueError(f"max_colocated_worker_groups must be >= 1, got {max_colocated_worker_groups}")
        if not ray.is_initialized():
            raise ClusterError("Ray is not initialised: call posttrain.distributed.ray_utils.init_ray() first")
        self.bundles_per_node = [int(n) for n in bundles_per_node]
        self.use_gpus = use_gpus
        self.cpus_per_bundle = float(cpus_per_bundle)
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.placement_timeout_s = placement_timeout_s
        self.name = name or "cluster"
        self._uid = uuid.uuid4().hex[:8]
        self._placement_groups: list[PlacementGroup] = self._reserve()
        self._bundle_node_ids = [placement_group_table(pg)["bundles_to_node_id"] for pg in self._placement_groups]

    # ------------------------------------------------------------------ reservation
    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_bundle}
        if self.use_gpus:
            bundle["GPU"] = 1.0
        return bundle

    def _reserve(self) -> list[PlacementGroup]:
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
        used: set[str] = set()
        targets: list[str | None] = []
        for count in self.bundles_per_node:
            need = {key: value * count for key, value in self._bundle().items()}
            fits = [
                node
                for node in alive
                if node not in used and all(available.get(node, {}).get(k, 0.0) >= v for k, v in need.items())
            ]
            targets.append(fits[0] if fits else None)
            if fits:
                used.add(fits[0])
        return targets

    def _placement_failure_message(self, ready_flags: list[bool]) -> str:
        bundle = self._bundle()
        lines = [
            f"VirtualCluster {self.name!r}: placement groups not ready after {self.placement_timeout_s:.1f}s "
            "(placement_timeout_s / cluster.placement_timeout_s).",
            f"  requested: {len(self.bundles_per_node)} node(s) with {self.bundles_per_node} bundles, "
            f"each bundle {bundle} (all bundles of a node on one machine); "
            f"total {self.world_size() * self.cpus_per_bundle:g} CPU"
            + (f", {self.world_size()} GPU" if self.use_gpus else ""),
            f"  placed: {sum(ready_flags)} of {len(ready_flags)} node groups",
            f"  Ray cluster total: {_plain(ray.cluster_resources())}; available: {_plain(ray.available_resources())}",
        ]
        available = ray_state.available_resources_per_node()
        for node in ray.nodes():
            if node["Alive"]:
                node_id = node["NodeID"]
                lines.append(
                    f"  node {node['NodeManagerAddress']} ({node_id[:8]}): total {_plain(node['Resources'])}, "
                    f"available {_plain(available.get(node_id, {}))}"
                )
        lines.append("  Lower the bundles / CPUs / GPUs asked for, or add nodes to the Ray cluster.")
        return "\n".join(lines)

    # ------------------------------------------------------------------ queries
    def world_size(self) -> int:
        """Total number of bundles (worker slots)."""
        return sum(self.bundles_per_node)

    def node_count(self) -> int:
        """Number of virtual nodes (placement groups)."""
        return len(self.bundles_per_node)

    def placement_groups(self) -> list[PlacementGroup]:
        """One placement group per virtual node."""
        self._check_alive()
        return list(self._placement_groups)

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

    def master_address_and_port(self, bundle: int = 0) -> tuple[str, int]:
        """IP of the node of `bundle` (default 0: rank 0) and a port free there now (rendezvous)."""
        pg, bundle_index = self.bundle_locations()[bundle]
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index)
        return ray.get(_free_address_and_port.options(scheduling_strategy=strategy).remote(), timeout=60)

    def shutdown(self) -> None:
        """Release the placement groups (idempotent). Actors on them are killed by Ray."""
        for pg in self._placement_groups:
            try:
                remove_placement_group(pg)
            except Exception as error:  # Ray already gone: nothing left to release
                logger.debug("remove_placement_group failed: %s", error)
        self._placement_groups = []

    def _check_alive(self) -> None:
        if not self._placement_groups:
            raise ClusterError(f"VirtualCluster {self.name!r} was shut down")

    def __repr__(self) -> str:
        return (
            f"VirtualCluster(name={self.name!r}, bundles_per_node={self.bundles_per_node}, use_gpus={self.use_gpus}, "
            f"cpus_per_bundle={self.cpus_per_bundle}, max_colocated_worker_groups={self.max_colocated_worker_groups})"
        )


@ray.remote(num_cpus=0)
def _free_address_and_port() -> tuple[str, int]:
    """Runs on the target node: its IP and a port the OS says is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _plain(resources: dict[str, Any]) -> dict[str, float]:
    """CPU / GPU entries only: Ray also lists memory and one key per bundle, noise here."""
    return {key: resources[key] for key in ("CPU", "GPU") if key in resources}
