"""One edit on several GPUs of one host: CFG-parallel and Ulysses sequence parallel over ``torch.distributed``.

* :mod:`.layout`: the user's choice (:class:`.layout.ParallelChoice`, a frozen value on the pipe plan) and its
  checks against the model and the machine.
* :mod:`.ulysses`: the all-to-all around the joint attention (sequence shards in, head shards for attention).
* :mod:`.denoise`: one rank's denoising loop (its half of true CFG, its sequence shard, one exchange per step).
* :mod:`.worker` / :mod:`.engine`: worker processes, one per GPU, started and supervised by the driver (ComfyUI's
  process), which sends each edit and gets progress, the latents and any error back.
"""
