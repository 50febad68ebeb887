"""injectors: corrupt real tensors on purpose during real distributed training."""
