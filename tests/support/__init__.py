"""What the tests lean on and are not tests themselves: servers and clusters a test starts and stops by pid, and
the helpers they share. Imported as `from support.<module> import ...` (pytest puts tests/ on sys.path, as it
does for `from conftest import ...`).

- `rayhead`: a Ray head on 127.0.0.1 that one test owns (`ray start --head --block`), stopped by pid.
- `s3server`: a moto S3 server and its fixtures (`s3`), with a TCP proxy (`tcpproxy`, run by path) to cut.
- `mlflowserver`, `promserver`: a real MLflow tracking server and a real Prometheus, skipped where absent.
- `netns`: real hosts in network namespaces on one machine, with links to cut, slow or make lossy.
- `ports`: a free loopback port, never one Ray takes by default.
- `inprocess`: the driver's loop without Ray: real ExpertWorker objects in this process.
- `tbloaders`: what TensorBoard's own loaders show of a log directory.
"""
