from capture_proxy.testing.fake_vllm import main

main()
