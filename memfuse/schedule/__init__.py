"""schedule: group a graph's nodes into kernels over [M, D] and extern steps; row order, matmul padding,
in-place extern calls."""
