"""schedule: group a graph's nodes into kernels over [M, D] and extern steps.

groups      schedule(): the stages in order; nodes grouped by stage and space, kernels named and checked
steps       Space, KernelGroup, ExternStep, Schedule: what a schedule is made of
reads       how the scheduler sees a node: its space, its reads from memory, what aliases what
placement   where a value is computed: in its readers, at its latest place, computed again
joins       kernels joined after grouping: sharing an input, run back to back, column sums hosted
reshapes    rewrites of reshapes an aten call reads and of casts of column sums
padding     matmul operands padded to aligned rows
reinplace   extern calls made in place
row_order   the order a kernel walks its rows in
"""
