"""What an op and a collective cost: device profiles and the α–β network model.

``Hardware`` holds the effective rates of one device (FLOP/s by kernel kind, bandwidths,
per-op and per-matrix overheads, the eigh cost per block); ``bench.results.calibrate``
measures one, and ``H100`` / ``H200`` hold datasheet values times stated efficiency
assumptions. ``Network`` prices a ``Collective`` on a cluster of NVLink nodes joined by
InfiniBand (ring or two-level algorithms).
"""

import math
from dataclasses import asdict, dataclass, field, replace

FALLBACK_RATES = {"gemm_update": "gemm_skinny"}  # a kind missing from an older profile
OP_KINDS = (
    "elementwise",
    "reduction",
    "gemm_fp32",
    "gemm_skinny",
    "gemm_update",
    "gemm_bf16",
    "bmm_fp32",
)


@dataclass(frozen=True)
class Collective:
    """One collective over ``group`` ranks; ``bytes`` is the full buffer (nccl-tests' size)."""

    kind: str  # "all_reduce", "all_gather", "all_to_all"
    bytes: float
    group: int
    count: int = 1


@dataclass(frozen=True)
class Hardware:
    """Effective rates of one device.

    ``rates``: FLOP/s by kernel kind (``gemm_fp32``, ``gemm_skinny``, ``gemm_update``,
    ``gemm_bf16``, ``qr``, ``small``);
    ``bmm_rates``: fp32 batched-matmul FLOP/s by block size (log-interpolated);
    ``latency_s``: fixed time per factorization call by kind; ``eigh_s``: ``(a, b)`` with
    ``a + b s³`` seconds per ``s x s`` block; ``op_s``: fixed cost of one op by kind
    (host dispatch, allocation, launch; ``elementwise`` also stands for any other kind).
    A kernel costs ``op_s[kind] + max(FLOPs / rate, bytes / memory_bandwidth)``.
    """

    name: str
    rates: dict[str, float]
    bmm_rates: dict[int, float]
    memory_bandwidth: float
    op_s: dict[str, float]
    eigh_s: tuple[float, float]
    latency_s: dict[str, float]
    foreach: bool = False
    alloc_s_per_byte: float = 0.0
    """Extra seconds per byte of a freshly allocated output (page faults on first touch;
    0 under CUDA's caching allocator)."""
    reduction_bandwidth: float = 0.0
    """Bytes per second a full reduction (norm, ``any``) reads; 0: ``memory_bandwidth``."""
    matrix_s: dict[str, float] = field(default_factory=dict)
    """Framework overhead beyond the ops: per matrix and call by optimizer name (Python
    loop, state lookups), and per hooked layer and forward (``"hook"``)."""
    source: str = ""
    measurements: dict = field(default_factory=dict)

    def bmm_rate(self, block: int) -> float:
        """fp32 bmm FLOP/s at block size ``block``: log-linear between measured sizes."""
        sizes = sorted(self.bmm_rates)
        if block <= sizes[0]:
            return self.bmm_rates[sizes[0]]
        if block >= sizes[-1]:
            return self.bmm_rates[sizes[-1]]
        hi = next(s for s in sizes if s >= block)
        lo = sizes[sizes.index(hi) - 1]
        t = math.log(block / lo) / math.log(hi / lo)
        return math.exp((1 - t) * math.log(self.bmm_rates[lo]) + t * math.log(self.bmm_rates[hi]))

    def launch(self, kind: str) -> float:
        """Fixed cost of one op of ``kind``."""
        return self.op_s.get(kind, self.op_s["elementwise"])

    def rate(self, kind: str) -> float | None:
        """FLOP/s of ``kind``; profiles measured before ``gemm_update`` existed use
        ``gemm_skinny``'s."""
        return self.rates.get(kind) or self.rates.get(FALLBACK_RATES.get(kind, ""))

    def eigh_block_s(self, size: int) -> float:
        a, b = self.eigh_s
        return a + b * size**3

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Hardware":
        data = {k: v for k, v in data.items() if k != "lab_names"}  # the record's naming
        data["bmm_rates"] = {int(k): v for k, v in data["bmm_rates"].items()}
        data["eigh_s"] = tuple(data["eigh_s"])
        return cls(**data)


# H100 SXM5 (NVIDIA H100 datasheet): dense BF16 tensor-core 989 TFLOP/s, FP32 (CUDA cores;
# PyTorch keeps TF32 off for matmul by default) 67 TFLOP/s, HBM3 3.35 TB/s. The efficiency
# factors below are our assumptions, not measurements on an H100.
H100_BF16_PEAK, H100_FP32_PEAK, H100_HBM = 989e12, 67e12, 3.35e12
GEMM_EFFICIENCY = 0.65  # large cuBLAS GEMMs: ~0.6-0.8 of peak (790/989 seen on an H200 here)
BMM_EFFICIENCY = 0.5  # fp32 block products (s = 100-400) and rank-r products: assumption
HBM_EFFICIENCY = 0.85  # copy bandwidth / datasheet (4.3 / 4.8 TB/s seen on an H200 here)
# PyTorch eager per-op cost on a fast host: dispatch ~5-10 us, hidden behind the GPU only
# when kernels are longer; assumption.
GPU_LAUNCH_S = 6e-6
# eigh per s x s fp32 block through torch.linalg.eigh on CUDA: for n > 32 PyTorch loops
# cuSOLVER syevd over the batch; pytorch/pytorch#174674 measured 914 ms for 500 blocks of
# 100 x 100 (1.8 ms a block; GPU not named). The s³ term (10 ms at s = 400) is an
# assumption. Dobb's batched refreshes are modeled op by op (costs.dobb.jacobi_kernels, and
# costs.traced.solver_kernels for cholqr, the CUDA default).
EIGH_TORCH_CUDA_S = (1.7e-3, 1.3e-10)
# cuSOLVER QR / Cholesky / triangular solve of small matrices: latency-bound; assumption.
GPU_FACTOR_LATENCY_S = {"qr": 150e-6, "small": 30e-6}
GPU_FACTOR_RATE = 2e12  # FLOP/s of those factorizations beyond the latency: assumption

H100 = Hardware(
    name="H100 SXM5 (datasheet x assumed efficiency)",
    rates={
        "gemm_fp32": H100_FP32_PEAK * GEMM_EFFICIENCY,
        "gemm_skinny": H100_FP32_PEAK * BMM_EFFICIENCY,
        "gemm_update": H100_FP32_PEAK * BMM_EFFICIENCY,
        "gemm_bf16": H100_BF16_PEAK * GEMM_EFFICIENCY,
        "qr": GPU_FACTOR_RATE,
        "small": GPU_FACTOR_RATE,
    },
    bmm_rates={64: H100_FP32_PEAK * BMM_EFFICIENCY},
    memory_bandwidth=H100_HBM * HBM_EFFICIENCY,
    op_s=dict.fromkeys(OP_KINDS, GPU_LAUNCH_S),
    eigh_s=EIGH_TORCH_CUDA_S,
    latency_s=GPU_FACTOR_LATENCY_S,
    foreach=True,
    source="NVIDIA H100 datasheet; efficiencies, launch and factorization costs assumed",
)
# H200: the H100's chip with HBM3e at 4.8 TB/s (NVIDIA H200 datasheet).
H200 = replace(H100, name="H200 (datasheet x assumed efficiency)", memory_bandwidth=4.8e12 * 0.9)

# A CUDA graph replays its kernels without host dispatch: the GPU launches each node after
# the last, so what an eager op pays on the host (GPU_LAUNCH_S) drops to the gap between
# kernels. NVIDIA's "Getting Started with CUDA Graphs" (developer.nvidia.com/blog/cuda-graphs/,
# V100) measured that gap below a microsecond for short kernels; 1 us on an H100 is our
# assumption (no replay was timed on the H200 here: benchmarks/gpu_check.sh times one).
GRAPH_LAUNCH_S = 1e-6


def captured(hw: Hardware, launch_s: float = GRAPH_LAUNCH_S) -> Hardware:
    """``hw`` replaying the call as a CUDA graph: every op's fixed cost is ``launch_s`` and no
    Python runs per matrix; rates, bandwidths and the factorizations' device-side latencies
    (``latency_s``, ``eigh_s``) are unchanged."""
    return replace(
        hw,
        name=f"{hw.name}, captured (CUDA graph replay)",
        op_s=dict.fromkeys(hw.op_s, launch_s),
        matrix_s={},
    )


@dataclass(frozen=True)
class Network:
    """α–β links of a cluster of ``gpus_per_node``-GPU nodes.

    Defaults: DGX H100-like nodes. NVLink 4 is 450 GB/s per direction per GPU (datasheet);
    nccl-tests bus bandwidth on 8 H100 is typically 350-480 GB/s, so we use 360 GB/s.
    InfiniBand NDR is 400 Gb/s = 50 GB/s per GPU (one ConnectX-7 per GPU); we use 40 GB/s
    effective. Latency per ring step: ~3 us inside a node, ~10 us between nodes
    (assumptions, NCCL's small-message latency is of that order).

    ``algorithm``: ``"ring"`` (one flat ring over all ranks: every step pays the slowest
    hop) or ``"hierarchical"`` (NCCL-like two-level: reduce-scatter inside the node, a
    ring across nodes on ``1/g`` of the data, all-gather inside the node).
    """

    gpus_per_node: int = 8
    alpha_intra: float = 3e-6
    beta_intra: float = 360e9
    alpha_inter: float = 10e-6
    beta_inter: float = 40e9
    algorithm: str = "hierarchical"

    def time(self, c: Collective) -> tuple[float, float]:
        """``(latency, bandwidth)`` seconds of ``c`` (times its count)."""
        p, g = c.group, self.gpus_per_node
        if p <= 1:
            return 0.0, 0.0
        if c.kind == "all_to_all":
            alpha = self.alpha_intra if p <= g else self.alpha_inter
            intra = c.bytes * (min(p, g) - 1) / p
            inter = c.bytes * max(p - g, 0) / p
            bw = max(intra / self.beta_intra, inter / self.beta_inter)
            return c.count * (p - 1) * alpha, c.count * bw
        ring = {"all_reduce": ring_all_reduce, "all_gather": ring_all_gather}[c.kind]
        if p <= g:
            lat, bw = ring(c.bytes, p, self.alpha_intra, self.beta_intra)
        elif self.algorithm == "ring":
            lat, bw = ring(c.bytes, p, self.alpha_inter, self.beta_inter)
        else:  # two levels: inside the node on the whole buffer, across nodes on 1/g of it
            nodes = math.ceil(p / g)
            intra = ring_all_gather(c.bytes, g, self.alpha_intra, self.beta_intra)
            inter = ring(c.bytes / g, nodes, self.alpha_inter, self.beta_inter)
            twice = 2 if c.kind == "all_reduce" else 1  # reduce-scatter + all-gather
            lat, bw = twice * intra[0] + inter[0], twice * intra[1] + inter[1]
        return c.count * lat, c.count * bw


def ring_all_reduce(nbytes: float, p: int, alpha: float, beta: float) -> tuple[float, float]:
    """Ring all-reduce of ``nbytes``: ``2 (p-1) α`` + ``2 (p-1)/p · n / β``."""
    if p <= 1:
        return 0.0, 0.0
    return 2 * (p - 1) * alpha, 2 * (p - 1) / p * nbytes / beta


def ring_all_gather(nbytes: float, p: int, alpha: float, beta: float) -> tuple[float, float]:
    """Ring all-gather of an ``nbytes`` output (reduce-scatter of an ``nbytes`` input):
    ``(p-1) α + (p-1)/p · n / β``."""
    if p <= 1:
        return 0.0, 0.0
    return (p - 1) * alpha, (p - 1) / p * nbytes / beta
