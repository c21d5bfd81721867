summary='llama3.1-8b: llama3.1-8b on 2 node(s) x 1 GPU(s), TP=1 x PP=2, engine gpu, context 131,072 tokens
Ray: head on vm-0 (127.0.0.2:22000), workers on vm-1; ports 22000-22299
vLLM listens on /tmp/llmlab-run-900001.7u45Yt/vllm.sock (private); its key-checking proxy on 127.0.0.1, on a free port it binds itself; clients use http://127.0.0.1:<that port>/v1 (the connection file and the READY line name it)'
job_name=llama3.1-8b
engine=gpu
served_model=llama3.1-8b
bind_host=127.0.0.1
host=127.0.0.1
port=0
uds=/tmp/llmlab-run-900001.7u45Yt/vllm.sock
expected_nodes=2
tp=1
pp=2
ray_timeout=600
ready_timeout=1800
serve_argv=(/opt/torch/.venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /tmp/llmlab-home-ku39pewp/model --tensor-parallel-size 1 --pipeline-parallel-size 2 --distributed-executor-backend ray --max-model-len 131072 --gpu-memory-utilization 0.9 --served-model-name llama3.1-8b --uds /tmp/llmlab-run-900001.7u45Yt/vllm.sock --load-format dummy)
serve_line='vllm serve /tmp/llmlab-home-ku39pewp/model --tensor-parallel-size 1 --pipeline-parallel-size 2 --distributed-executor-backend ray --max-model-len 131072 --gpu-memory-utilization 0.9 --served-model-name llama3.1-8b --uds /tmp/llmlab-run-900001.7u45Yt/vllm.sock --load-format dummy'
nodes=(vm-0 vm-1)
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
export VLLM_RPC_BASE_PATH=/tmp/llmlab-run-900001.7u45Yt
export RAY_ADDRESS=127.0.0.2:22000
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
export RAY_USAGE_STATS_ENABLED=0
export RAY_enable_worker_prestart=0
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=/tmp/llmlab-home-ku39pewp/keys/ray-job-900001.token
ray_address=127.0.0.2:22000
ray_expected_gpus=2
ray_temp_dir=/tmp/llmlab-ray.TblaGD/ray
ray_head_cmd='ray start --head --port=22000 --node-ip-address=127.0.0.2 --ray-client-server-port=22001 --include-dashboard=false --dashboard-port=22002 --node-manager-port=22100 --object-manager-port=22101 --dashboard-agent-listen-port=22102 --dashboard-agent-grpc-port=22103 --metrics-export-port=22104 --runtime-env-agent-port=22105 --min-worker-port=22110 --max-worker-port=22199 --num-gpus=1 --temp-dir=/tmp/llmlab-ray.TblaGD/ray --block'
ray_worker_cmds=('ray start --address=127.0.0.2:22000 --node-ip-address=127.0.0.2 --node-manager-port=22200 --object-manager-port=22201 --dashboard-agent-listen-port=22202 --dashboard-agent-grpc-port=22203 --metrics-export-port=22204 --runtime-env-agent-port=22205 --min-worker-port=22210 --max-worker-port=22299 --num-gpus=1 --temp-dir=/tmp/llmlab-ray.TblaGD/ray --block')