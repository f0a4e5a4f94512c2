"""dspark: train and prove a DSpark speculative-decoding draft for a target LLM.

The library. It never imports Prefect or MLflow: orchestration (flows/, tasks/) and tracking
live at the edge and call in here.
"""

__version__ = "0.1.0"
