"""The OpenAI Batch API (/v1/files, /v1/batches) served over HTTP beside the planner's gRPC."""
