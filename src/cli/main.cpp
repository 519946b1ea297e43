#include <cstdio>
int main() { std::puts("k3decode: in progress"); return 0; }
