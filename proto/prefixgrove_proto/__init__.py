"""The planner's gRPC contract: modules generated from ../planner.proto by `generate.py`."""
