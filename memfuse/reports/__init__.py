"""Reports on top of the pipeline: explain(), pictures of the plan and memory, the op coverage table."""
