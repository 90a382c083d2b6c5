"""Running a scheduled batch on the device: the step's inputs built in one copy, the model forward
(CUDA graphs for decode, windows of decode steps), and the timeline of its GPU work."""
