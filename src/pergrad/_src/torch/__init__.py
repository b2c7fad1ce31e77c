"""PyTorch integrations: ``module_loss``, ``DPOptimizer``, ``torch.distributed`` DP-SGD, a Poisson batch sampler. Imported only when used."""
