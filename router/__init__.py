"""splitserve router: the asyncio front door (gRPC, OpenAI HTTP). Never imports torch or vllm."""
