"""splitserve: disaggregated prefill/decode serving around vLLM (shared core package)."""
