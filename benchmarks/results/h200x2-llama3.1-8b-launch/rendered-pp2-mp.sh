summary='llama3.1-8b: llama3.1-8b on 2 node(s) x 1 GPU(s), TP=1 x PP=2, engine gpu, context 131,072 tokens
no Ray: vLLM'"'"'s own processes on each node (--nnodes 2), the head on vm-0 (127.0.0.2:22000), headless workers on vm-1
vLLM listens on /tmp/llmlab-run-900001.tQTNQm/vllm.sock (private); its key-checking proxy on 127.0.0.1, on a free port it binds itself; clients use http://127.0.0.1:<that port>/v1 (the connection file and the READY line name it)'
job_name=llama3.1-8b
engine=gpu
served_model=llama3.1-8b
bind_host=127.0.0.1
host=127.0.0.1
port=0
uds=/tmp/llmlab-run-900001.tQTNQm/vllm.sock
expected_nodes=2
tp=1
pp=2
ray_timeout=600
ready_timeout=1800
serve_argv=(/opt/torch/.venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /tmp/llmlab-home-9mxorzw2/model --tensor-parallel-size 1 --pipeline-parallel-size 2 --distributed-executor-backend mp --max-model-len 131072 --gpu-memory-utilization 0.9 --nnodes 2 --served-model-name llama3.1-8b --uds /tmp/llmlab-run-900001.tQTNQm/vllm.sock --load-format dummy --node-rank 0 --master-addr 127.0.0.2 --master-port 22000)
serve_line='vllm serve /tmp/llmlab-home-9mxorzw2/model --tensor-parallel-size 1 --pipeline-parallel-size 2 --distributed-executor-backend mp --max-model-len 131072 --gpu-memory-utilization 0.9 --nnodes 2 --served-model-name llama3.1-8b --uds /tmp/llmlab-run-900001.tQTNQm/vllm.sock --load-format dummy --node-rank 0 --master-addr 127.0.0.2 --master-port 22000'
nodes=(vm-0 vm-1)
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
export VLLM_RPC_BASE_PATH=/tmp/llmlab-run-900001.tQTNQm
ray_address=
ray_expected_gpus=0
ray_temp_dir=
ray_head_cmd=
ray_worker_cmds=()
mp_master=127.0.0.2:22000
mp_worker_cmds=('/opt/torch/.venv/bin/python3 -m vllm.entrypoints.cli.main serve /tmp/llmlab-home-9mxorzw2/model --tensor-parallel-size 1 --pipeline-parallel-size 2 --distributed-executor-backend mp --max-model-len 131072 --gpu-memory-utilization 0.9 --nnodes 2 --served-model-name llama3.1-8b --load-format dummy --node-rank 1 --master-addr 127.0.0.2 --master-port 22000 --headless')