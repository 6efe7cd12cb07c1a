"""Front doors: memory_efficient_fusion for functions and modules, and the torch.compile backend."""
