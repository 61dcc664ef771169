"""The cluster as a job sees it: resources and profiles, submission (sbatch, salloc, submitit), the distributed
contract from Slurm's variables, requeue, the writer lock, MPI and Lustre. The development cluster is in
:mod:`clipforge.hpc.devcluster`."""
