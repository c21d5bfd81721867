summary='llama3.1-8b: llama3.1-8b on 1 node(s) x 1 GPU(s), TP=1 x PP=1, engine gpu, context 131,072 tokens
Ray: not needed (one node: vLLM starts its own worker processes)
vLLM listens on /tmp/llmlab-run-900001.IKdS8J/vllm.sock (private); its key-checking proxy on 0.0.0.0, on a free port it binds itself; clients use http://vm:<that port>/v1 (the connection file and the READY line name it)'
job_name=llama3.1-8b
engine=gpu
served_model=llama3.1-8b
bind_host=0.0.0.0
host=vm
port=0
uds=/tmp/llmlab-run-900001.IKdS8J/vllm.sock
expected_nodes=1
tp=1
pp=1
ray_timeout=600
ready_timeout=1800
serve_argv=(/opt/torch/.venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /tmp/llmlab-home-8dzlesll/model --tensor-parallel-size 1 --max-model-len 131072 --gpu-memory-utilization 0.9 --enable-prompt-tokens-details --served-model-name llama3.1-8b --uds /tmp/llmlab-run-900001.IKdS8J/vllm.sock --load-format dummy --api-server-count 4)
serve_line='vllm serve /tmp/llmlab-home-8dzlesll/model --tensor-parallel-size 1 --max-model-len 131072 --gpu-memory-utilization 0.9 --enable-prompt-tokens-details --served-model-name llama3.1-8b --uds /tmp/llmlab-run-900001.IKdS8J/vllm.sock --load-format dummy --api-server-count 4'
nodes=(vm)
stage_argv=()
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
export VLLM_RPC_BASE_PATH=/tmp/llmlab-run-900001.IKdS8J
ray_address=
ray_expected_gpus=0
ray_temp_dir=
ray_head_cmd=
ray_worker_cmds=()
mp_master=''
mp_port=0
mp_worker_cmds=()