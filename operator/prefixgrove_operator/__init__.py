"""The kopf operator: BatchJob lifecycle and worker autoscaling. Reaches the planner only through its
gRPC client and the proto."""
