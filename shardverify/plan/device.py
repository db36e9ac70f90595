"""The device a plan's declared seconds and bytes are for: a named profile (an accelerator's peak
arithmetic rate and memory bandwidth, its memory, and the links within and across nodes), so that
every figure a plan prints says what machine it assumes.

The figures are the vendors' published peaks (dense bfloat16 tensor-core rates, HBM bandwidth,
NVLink and one InfiniBand NIC per device); a real training step reaches a fraction of them, so
declared seconds are a lower bound that ranks plans, not a forecast. ``nominal`` is the
project's long-standing cost model (1e10 multiply-adds/s, every link 10 GB/s, no memory limit):
not a real device, and said so. ``calibrated`` takes its links' alpha and beta from a
``shardverify calibrate`` file for the mesh (a real backend measured), the rest nominal.

Mesh axes map onto links by rank order: ranks are laid out row-major, so the last axes hold
neighbouring ranks; the trailing axes whose sizes multiply to at most ``devices_per_node`` run
over the links within a node, the others across nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardverify.errors import InvalidArgument
from shardverify.sharding.calibration_file import load_rate
from shardverify.sharding.mesh import DEFAULT_ALPHA, DEFAULT_BETA, DeviceMesh

__all__ = ["Link", "DeviceProfile", "PROFILES", "NOMINAL", "device_profile"]

GIB = 2 ** 30


@dataclass(frozen=True)
class Link:
    """A link's latency (seconds per collective step) and seconds per byte (1 / bandwidth)."""

    alpha: float
    beta: float

    @classmethod
    def of(cls, latency_s: float, gigabytes_per_s: float) -> Link:
        return cls(latency_s, 1.0 / (gigabytes_per_s * 1e9))


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator and its links, as the solver costs them."""

    name: str
    about: str                        # what the figures are and where they come from
    multiply_adds_per_s: float        # peak: half the published FLOP/s (one multiply-add is two)
    memory_bytes_per_s: float         # memory bandwidth; math.inf: arithmetic alone times a node
    memory_bytes: int | None          # device memory; None: no limit unless one is given
    devices_per_node: int | None      # None: every axis on the same link
    within: Link                      # the links between devices of one node
    across: Link                      # the links between nodes
    measured: tuple[Link, ...] = ()   # one link per mesh axis, as measured (the calibrated profile)

    def axis_links(self, shape: tuple[int, ...]) -> tuple[Link, ...]:
        """The link each mesh axis runs over (trailing axes within a node while they fit)."""
        if self.measured:
            if len(self.measured) != len(shape):
                raise InvalidArgument(f"device profile {self.name!r} was measured on a mesh of {len(self.measured)} "
                                      f"axes, not {tuple(shape)}")
            return self.measured
        links = [self.across] * len(shape)
        span = 1
        for axis in reversed(range(len(shape))):
            span *= shape[axis]
            if self.devices_per_node is None or span <= self.devices_per_node:
                links[axis] = self.within
            else:
                break
        return tuple(links)

    def mesh(self, shape: tuple[int, ...]) -> DeviceMesh:
        """A mesh of ``shape`` whose axes are priced by this profile's links."""
        links = self.axis_links(tuple(shape))
        return DeviceMesh(tuple(shape), alpha=tuple(link.alpha for link in links),
                          beta=tuple(link.beta for link in links))

    def seconds(self, multiply_adds: float, traffic_bytes: float) -> float:
        """A kernel's time on this device: bound by arithmetic or by memory traffic, whichever is slower."""
        return max(multiply_adds / self.multiply_adds_per_s, traffic_bytes / self.memory_bytes_per_s)

    @property
    def label(self) -> str:
        if self.name == "nominal":
            return "nominal (a unit cost model, not a real device)"
        memory = f"{self.memory_bytes / GIB:.4g} GiB" if self.memory_bytes else "no memory limit"
        return f"{self.name} ({2 * self.multiply_adds_per_s / 1e12:.4g} TFLOP/s, {memory})"

    def to_json(self) -> dict:
        return {"name": self.name, "about": self.about, "peak_flops": 2 * self.multiply_adds_per_s,
                "memory_bandwidth": None if math.isinf(self.memory_bytes_per_s) else self.memory_bytes_per_s,
                "memory_bytes": self.memory_bytes, "devices_per_node": self.devices_per_node,
                "within_node": {"alpha": self.within.alpha, "beta": self.within.beta},
                "across_nodes": {"alpha": self.across.alpha, "beta": self.across.beta}}


_NOMINAL_LINK = Link(DEFAULT_ALPHA, DEFAULT_BETA)

NOMINAL = DeviceProfile(
    "nominal", "the project's unit cost model, not a real device: 1e10 multiply-adds/s, every link 10 GB/s "
    "with 10 us per step, memory traffic not timed, no memory limit",
    1e10, math.inf, None, None, _NOMINAL_LINK, _NOMINAL_LINK)


def _gpu(name: str, about: str, tflops: float, hbm_tb_s: float, memory: int, nvlink_gb_s: float,
         nic_gb_s: float) -> DeviceProfile:
    """A GPU of an 8-device node: NVLink within it (one direction's bandwidth), one NIC per device across."""
    return DeviceProfile(name, about, tflops * 1e12 / 2, hbm_tb_s * 1e12, memory, 8,
                         Link.of(5e-6, nvlink_gb_s), Link.of(1e-5, nic_gb_s))


#: the named profiles (``--device NAME``)
PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    NOMINAL,
    _gpu("a100-80gb", "NVIDIA A100 SXM 80GB: 312 TFLOP/s dense bf16, 2.04 TB/s HBM2e, NVLink 3 at 300 GB/s each "
         "way, 8 per node, one 200 Gb/s HDR InfiniBand NIC per GPU", 312, 2.039, 80 * GIB, 300, 25),
    _gpu("h100-80gb", "NVIDIA H100 SXM 80GB: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 at 450 GB/s each "
         "way, 8 per node, one 400 Gb/s NDR InfiniBand NIC per GPU", 989, 3.35, 80 * GIB, 450, 50),
    _gpu("h200-141gb", "NVIDIA H200 SXM 141GB: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, NVLink 4 at 450 GB/s each "
         "way, 8 per node, one 400 Gb/s NDR InfiniBand NIC per GPU", 989, 4.8, 141 * 10 ** 9, 450, 50),
)}


def device_profile(name: str, shape: tuple[int, ...] | None = None) -> DeviceProfile:
    """The profile ``name``; ``calibrated`` needs the mesh ``shape`` whose calibration file to read."""
    if name == "calibrated":
        if shape is None:
            raise InvalidArgument("the calibrated device profile needs a mesh shape")
        mesh = DeviceMesh.calibrated(tuple(shape))
        links = tuple(Link(a, b) for a, b in zip(mesh.alpha, mesh.beta))
        rate = load_rate(tuple(shape))
        arithmetic = (f"the slowest rank's float32 matmul at {rate:.3g} multiply-adds/s" if rate
                      else "arithmetic nominal (1e10 multiply-adds/s: the file predates its measurement)")
        return DeviceProfile(
            "calibrated", f"measured by 'shardverify calibrate' for mesh {tuple(shape)}: each axis' link, {arithmetic}; "
            f"memory traffic not timed, no memory limit",
            rate or 1e10, math.inf, None, None, links[-1], links[0], links)
    if name not in PROFILES:
        raise InvalidArgument(f"unknown device profile {name!r}; the profiles are "
                              f"{', '.join([*PROFILES, 'calibrated'])}")
    return PROFILES[name]
