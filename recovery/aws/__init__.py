"""AWS: SageMaker HyperPod node replacement and reboot, and what botocore's failures mean.

- :mod:`~recovery.aws.hyperpod` — :class:`HyperPod` (boto3 ``sagemaker``);
- :mod:`~recovery.aws.errors` — botocore errors as :mod:`recovery.errors` types, shared by every
  AWS adapter (the S3 checkpoint store too);
- :mod:`~recovery.aws.moto_hyperpod` — HyperPod's node operations for moto, which has none;
- :mod:`~recovery.aws.local` — moto on 127.0.0.1 with a demo HyperPod cluster, for the demo and
  the rehearsal of a recorded incident.
"""

from recovery.aws.hyperpod import HyperPod, sagemaker_client

__all__ = ["HyperPod", "sagemaker_client"]
