"""Request state, KV cache, model runner, sampler and the loop that drives them."""
