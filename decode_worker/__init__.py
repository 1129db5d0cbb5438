"""splitserve decode_worker package."""
