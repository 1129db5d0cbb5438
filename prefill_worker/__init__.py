"""splitserve prefill_worker package."""
