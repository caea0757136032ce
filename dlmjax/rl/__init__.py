"""Reinforcement learning for masked DLMs: group advantages, log-prob estimators, policy losses."""
