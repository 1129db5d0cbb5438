"""What every worker role shares: config, proto↔vLLM conversion, gRPC server lifecycle,
registration with the router. The role-specific servicers live in prefill_worker/ and
decode_worker/."""
