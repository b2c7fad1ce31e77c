"""The public entry points over the strategies: per-example gradients (``grads.py``) and
per-example norms, plug-in layer reductions and the strategy choice (``reductions.py``). Each
analyses its call once (``core/call.py``) and hands it to a strategy (``strategies/``); the DP
reductions of a loss (``clipped_sum_of``, ``private_grad_of``) are ``dp/from_loss.py``'s."""
