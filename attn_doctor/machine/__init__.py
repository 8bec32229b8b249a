"""Facts about the machine: its fingerprint, what TE loaded and the devices. (The known TE/cuDNN defects that
match it are `attn_doctor.known_defects`.)"""
