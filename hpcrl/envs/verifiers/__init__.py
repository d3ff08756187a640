"""Adapters for verifiers environments: the classic 0.3 API (adapter03) and 0.4's v1 env servers (v1_env, v1_runtime, v1_serve); versions says which is installed."""
