"""Several processes, one model, on torch.distributed (chapter 12): the parallel layers and collectives."""
