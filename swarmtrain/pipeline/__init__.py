"""Pipeline runs of ``swarmtrain``: stage server and trainer roles (``roles``, ``node``), the model
cut into stages (``model``), trainers' progress records (``progress``) and ``swarmtrain local
--pipeline-stages`` (``local``).
"""
