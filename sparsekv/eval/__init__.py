"""Evaluation tasks (passkey; RULER and perplexity come next), scored the way their papers score them."""
