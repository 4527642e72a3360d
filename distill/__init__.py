"""distill: align a draft to its target (DistillSpec-style knowledge distillation), and measure how well it serves.

``config`` (the YAML schema), ``divergences`` (forward/reverse KL, TVD, JSD), ``data`` (training-split text),
``module`` (the LightningModule), ``run`` (the job, tracked in MLflow), ``evaluate`` (acceptance and confidence
calibration on decode-time contexts), ``saving`` (safetensors in a storage dtype).
"""
