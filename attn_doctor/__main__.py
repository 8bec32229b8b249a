from attn_doctor.cli import main

main()
