"""Float64 references shared by the tests of several optimizers: the orthogonalizers written
out step by step, the row blocks of a matrix, and the batch Dion2's family is checked on.

Each is a transcription of a formula, recomputed on the machine running the test (never a
recorded tensor); a test of one optimizer imports what it needs from here, not from
another test module.
"""

import torch

from dobb.optim.muon import NS_A, NS_B, NS_C, POLAR_EXPRESS

# three of one shape (two cut into 3 selection blocks, one whole: two stacks), two wide,
# a lone tall matrix: the batch of Dion2's and NorDion2's batched forms
BATCH_SHAPES = [(18, 16)] * 3 + [(8, 24)] * 2 + [(30, 6)]
BATCH_BLOCKS = [[6, 6, 6], [18], [6, 6, 6], [8], [8], [10, 10, 10]]


def ns5_float64(G):
    """Keller's quintic Newton-Schulz, written out in float64."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.T
        X = NS_A * X + (NS_B * A + NS_C * A @ A) @ X
    return X.T if tall else X


def polar_express_float64(G, steps):
    """Polar Express (arXiv 2505.16932) written out in float64: X / (1.02 ||X||_F + eps),
    then step i's quintic from the table (later steps repeat its last)."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / (1.02 * X.norm() + 1e-7)
    for i in range(steps):
        a, b, c = POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)]
        A = X @ X.T
        X = a * X + b * A @ X + c * A @ A @ X
    return X.T if tall else X


def block_sizes(m, parts):
    """torch.chunk's split of m rows into ``parts`` blocks (empty blocks kept)."""
    sizes = [len(c) for c in torch.arange(m).chunk(parts)]
    return sizes + [0] * (parts - len(sizes))
