"""What a job costs before it runs: the FLOPs and bytes of its steps from the model's shapes
(`shape.py`), the devices' peak rates (`devices.py`), efficiencies fitted to this repository's own
benchmark runs (`calibration.py`, the table `calibration_table.py` that `benchmarks/calibrate.py`
writes), and the prediction that joins them (`predict.py`). Imports no engine and no service, so
the planner and the CLI plan a job without a device.
"""
